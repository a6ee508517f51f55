"""One trial's outcome, as the command and the test report it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Trial:
    kind: str
    """kill, race, hostile, identifiers, faults"""
    name: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    figures: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.problems

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        extra = f" {self.figures}" if self.figures else ""
        notes = f" ({'; '.join(self.notes)})" if self.notes else ""
        out = f"{verdict} {self.kind:<11} {self.name} [{self.seconds:.0f}s]{extra}{notes}"
        return out + "".join(f"\n     - {p}" for p in self.problems[:12])
