"""One decoder per source format, all producing the canonical change model."""

from __future__ import annotations

import importlib

from cdc_apply.decode.base import DecodeContext, Decoder, decode_all
from cdc_apply.model import Format

_MODULES = {
    Format.DEBEZIUM_SQLSERVER: ("debezium_sqlserver", "DebeziumSqlServerDecoder"),
    Format.DEBEZIUM_POSTGRES: ("debezium_postgres", "DebeziumPostgresDecoder"),
    Format.SQLSERVER_CES: ("sqlserver_ces", "SqlServerCesDecoder"),
    Format.QLIK: ("qlik", "QlikDecoder"),
    Format.COCKROACHDB: ("cockroachdb", "CockroachDbDecoder"),
}


def decoder_class(fmt: Format | str) -> type[Decoder]:
    module, cls = _MODULES[Format(fmt)]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def make_decoder(fmt: Format | str, ctx: DecodeContext | None = None) -> Decoder:
    return decoder_class(fmt)(ctx)


def detect_format(first_messages: list[str]) -> Format | None:
    """Convenience auto-detection from a file's first messages (sources should
    configure their format; this only helps the CLI and the demo)."""
    for fmt in Format:
        cls = decoder_class(fmt)
        if any(cls.sniff(text) for text in first_messages if text.strip()):
            return fmt
    return None


__all__ = ["DecodeContext", "Decoder", "decode_all", "decoder_class", "detect_format", "make_decoder"]
