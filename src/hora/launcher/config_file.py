"""``--config-file``: a YAML file of ``hora run`` flag values.

Keys are flag names (``np``, ``hosts``, ``fusion-threshold-mb`` or ``fusion_threshold_mb``...); Horovod's
sections are read too (``controller``, ``params``, ``autotune``, ``timeline``, ``stall_check``,
``library_options``, ``logging``, as horovodrun's config_parser). Flags on the command line win over the file.

Example (``job.yaml``):
    np: 4
    hosts: node1:2,node2:2
    timeline: {filename: /tmp/t.json}
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any

import yaml

from hora.errors import ConfigError

# Horovod's sectioned keys -> argparse dests.
_SECTIONS: dict[str, dict[str, str]] = {
    "params": {"fusion_threshold_mb": "fusion_threshold_mb", "cycle_time_ms": "cycle_time_ms",
               "cache_capacity": "cache_capacity", "hierarchical_allreduce": "hierarchical_allreduce",
               "hierarchical_allgather": "hierarchical_allgather", "torus_allreduce": "torus_allreduce"},
    "autotune": {"enabled": "autotune", "log_file": "autotune_log_file",
                 "warmup_samples": "autotune_warmup_samples", "steps_per_sample": "autotune_steps_per_sample",
                 "bayes_opt_max_samples": "autotune_bayes_opt_max_samples",
                 "gaussian_process_noise": "autotune_gaussian_process_noise"},
    "timeline": {"filename": "timeline_filename", "mark_cycles": "timeline_mark_cycles"},
    "stall_check": {"warning_time_seconds": "stall_check_warning_time_seconds",
                    "shutdown_time_seconds": "stall_check_shutdown_time_seconds", "enabled": "!no_stall_check"},
    "library_options": {"mpi_threads_disable": "mpi_threads_disable", "num_nccl_streams": "num_nccl_streams",
                        "thread_affinity": "thread_affinity", "gloo_timeout_seconds": "gloo_timeout_seconds"},
    "logging": {"level": "log_level", "with_timestamp": "log_with_timestamp"},
}
# Horovod's `controller: gloo|mpi` -> the flag it stands for.
_CONTROLLERS = {"gloo": "gloo", "mpi": "mpi"}


def _flatten(data: dict[str, Any], path: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        key = str(key).replace("-", "_")
        if key == "controller" and isinstance(value, str):
            if value.lower() not in _CONTROLLERS:
                raise ConfigError(f"--config-file {path}: controller {value!r}: use gloo (or mpi, which hora refuses "
                                  "with the reason)")
            flat[_CONTROLLERS[value.lower()]] = True
        elif key in _SECTIONS and isinstance(value, dict):
            for sub, sub_value in value.items():
                dest = _SECTIONS[key].get(str(sub))
                if dest is None:
                    raise ConfigError(f"--config-file {path}: unknown key {key}.{sub}")
                if dest.startswith("!"):
                    flat[dest[1:]] = not sub_value
                else:
                    flat[dest] = sub_value
        else:
            flat[key] = value
    return flat


def _convert(action: argparse.Action, value: Any, path: str) -> Any:
    flag = action.option_strings[-1]
    if action.nargs == 0:  # store_true
        if not isinstance(value, bool):
            raise ConfigError(f"--config-file {path}: {flag} must be true or false, got {value!r}")
        return value
    if action.dest in ("x", "ssh_option", "network_interfaces"):
        return [str(v) for v in value] if isinstance(value, list) else [str(value)]
    if isinstance(value, (dict, list)):
        raise ConfigError(f"--config-file {path}: {flag} takes one value, got {type(value).__name__}")
    kind = action.type if callable(action.type) else str
    try:
        converted = kind(str(value)) if kind is not str else str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--config-file {path}: {flag} value {value!r} is not a valid "
                          f"{getattr(kind, '__name__', 'value')}") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigError(f"--config-file {path}: {flag} must be one of {', '.join(map(str, action.choices))}")
    return converted


def load_config_file(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Read ``path`` and return ``{argparse dest: value}``.

    Raises:
        ConfigError: the file is missing, not YAML, not a mapping, or has an unknown key or a bad value.
    """
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config-file {path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"--config-file {path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"--config-file {path}: not valid YAML{where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config-file {path}: expected a mapping of flag: value, got {type(data).__name__}")
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    values: dict[str, Any] = {}
    for key, value in _flatten(data, path).items():
        if key in ("config_file", "command") or key not in actions:
            close = difflib.get_close_matches(key, list(actions), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"--config-file {path}: unknown key {key!r}{hint}")
        values[key] = _convert(actions[key], value, path)
    return values
