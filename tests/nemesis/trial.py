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

    @property
    def void(self) -> bool:
        """A kill trial whose kill never landed (the armed run ended first):
        it passed, but it tested nothing and is not counted as a kill."""
        return self.kind == "kill" and self.figures.get("killed") == 0

    def line(self) -> str:
        verdict = "FAIL" if not self.passed else "VOID" if self.void else "PASS"
        extra = f" {self.figures}" if self.figures else ""
        notes = f" ({'; '.join(self.notes)})" if self.notes else ""
        out = f"{verdict} {self.kind:<11} {self.name} [{self.seconds:.0f}s]{extra}{notes}"
        return out + "".join(f"\n     - {p}" for p in self.problems[:12])
