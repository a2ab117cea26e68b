"""Startup configuration: `config.toml` < KVSERVE_* environment < command-line flags, merged
into one typed object (server settings + `EngineConfig`) that is passed down."""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.config import EngineConfig

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "config.toml"
_ZERO_IS_NONE = {"num_kv_blocks", "max_model_len", "block_size"}
_EMPTY_IS_NONE = {"model"}


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = ""  # one key, or several separated by commas
    salt_cache_per_key: bool = False
    served_model_name: str = ""
    allowed_origins: list[str] = field(default_factory=list)
    max_queue_len: int = 256
    max_body_bytes: int = 4_194_304
    max_n: int = 16
    max_top_logprobs: int = 20
    max_stop_sequences: int = 16
    max_stop_length: int = 256
    # chat requests that name no max_tokens: 0 = the rest of the context (vLLM's behaviour)
    default_max_tokens: int = 0
    log_level: str = "info"
    request_timeout_s: float = 0.0  # abort a request running longer than this; 0 = off
    shutdown_grace_s: float = 30.0  # on SIGTERM, let in-flight requests finish this long
    idle_seconds: float = 0.0  # offload a session's KV to the host tier after this idle time


@dataclass(slots=True)
class Config:
    server: ServerConfig
    engine: EngineConfig


def _coerce(value: str, default: Any) -> Any:
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(value)
    if isinstance(default, float):
        return float(value)
    if isinstance(default, list):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


def _defaults() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cls in (ServerConfig, EngineConfig):
        inst = cls()
        out.update({f.name: getattr(inst, f.name) for f in fields(cls)})
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvserve", description="OpenAI-compatible LLM server")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="TOML file of defaults")
    for name, default in _defaults().items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            ap.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction)
        elif isinstance(default, list):
            ap.add_argument(flag, dest=name, default=None, nargs="*")
        else:
            kind = type(default) if default is not None else str
            if name in _ZERO_IS_NONE:
                kind = int
            ap.add_argument(flag, dest=name, default=None, type=kind)
    return ap


def load_config(argv: list[str] | None = None, env: dict[str, str] | None = None) -> Config:
    args = build_parser().parse_args(argv)
    env = dict(os.environ) if env is None else env
    defaults = _defaults()
    values: dict[str, Any] = {}
    path = Path(args.config)
    if path.is_file():
        with open(path, "rb") as f:
            for section in tomllib.load(f).values():
                if isinstance(section, dict):
                    values.update(section)
    unknown = set(values) - set(defaults)
    if unknown:
        raise SystemExit(f"{path}: unknown settings {sorted(unknown)}")
    for name, default in defaults.items():
        raw = env.get("KVSERVE_" + name.upper())
        if raw is not None:
            values[name] = _coerce(raw, default if default is not None else "")
        flag = getattr(args, name)
        if flag is not None:
            values[name] = flag
    for name in _ZERO_IS_NONE:
        if values.get(name) == 0:
            values[name] = None
    for name in _EMPTY_IS_NONE:
        if values.get(name) == "":
            values[name] = None
    server = ServerConfig(**{k: v for k, v in values.items() if k in ServerConfig.__slots__})
    engine = EngineConfig(**{k: v for k, v in values.items() if k in EngineConfig.__slots__})
    engine.validate()
    if server.default_max_tokens < 0:
        raise SystemExit("default_max_tokens must be >= 0 (0: the rest of the context)")
    return Config(server, engine)
