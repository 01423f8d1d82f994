"""Knobs (hora.common.knobs): defaults written once, hora's names and Horovod's aliases read (hora's winning),
bad values named, every Horovod variable read or listed, and docs/knobs.md as generated."""

from __future__ import annotations

import pathlib

import pytest

from hora.common.knobs import (
    HOROVOD_ONLY,
    KNOBS,
    Knobs,
    horovod_only_markdown,
    ignored_horovod_variables,
    knobs_markdown,
)
from hora.errors import ConfigError

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "knobs.md"


def test_docs_list_every_knob_as_generated() -> None:
    text = DOC.read_text()
    assert knobs_markdown() in text and text.endswith(horovod_only_markdown()), \
        "docs/knobs.md is stale: run python scripts/gen_knobs_doc.py"
    for knob in KNOBS:
        assert f"`{knob.name}`" in text


def test_every_horovod_variable_of_common_h_is_read_or_listed() -> None:
    """Each HOROVOD_* variable of Horovod 0.28.1's horovod/common/common.h (from its sdist) is a knob's alias
    or listed as having no mechanism in hora; and a set one of the latter is reported."""
    import re

    from tests.horovod_sdist import horovod_sdist

    header = (horovod_sdist() / "horovod" / "common" / "common.h").read_text()
    variables = {name for name, value in re.findall(r'#define (HOROVOD_\w+) "(\w+)"', header) if name == value}
    assert len(variables) > 25, variables
    read = {k.horovod for k in KNOBS if k.horovod} | {"HOROVOD_ELASTIC_TIMEOUT"}
    listed = {name for name, _ in HOROVOD_ONLY}
    assert sorted(variables - read - listed) == []
    assert ignored_horovod_variables({"HOROVOD_NUM_NCCL_STREAMS": "2", "HOROVOD_FUSION_THRESHOLD": "1"}) == [
        "HOROVOD_NUM_NCCL_STREAMS=2: hora issues every GPU collective on one launch stream per rank"]


def test_hora_name_wins_over_horovod_alias() -> None:
    knobs = Knobs.from_environ({"HOROVOD_STALL_CHECK_TIME_SECONDS": "7", "HORA_STALL_CHECK_TIME_SECONDS": "3"})
    assert knobs.stall_check_time_seconds == 3.0


@pytest.mark.parametrize(("name", "raw"), [("HORA_FUSION_THRESHOLD", "lots"), ("HORA_STALL_CHECK_DISABLE", "maybe")])
def test_bad_values_name_the_variable(name: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=name):
        Knobs.from_environ({name: raw})


def test_defaults_hora_names_and_horovod_aliases_are_read() -> None:
    assert Knobs.from_environ({}) == Knobs()
    k = Knobs.from_environ({"HOROVOD_FUSION_THRESHOLD": "1024", "HORA_LOG_LEVEL": "debug",
                            "HOROVOD_LOG_LEVEL": "error", "HOROVOD_STALL_CHECK_DISABLE": "1",
                            "HOROVOD_STALL_CHECK_TIME_SECONDS": "7", "HORA_TIMELINE_MARK_CYCLES": "yes"})
    assert (k.fusion_threshold, k.log_level, k.stall_check_disable, k.stall_check_time_seconds,
            k.timeline_mark_cycles) == (1024, "debug", True, 7.0, True)
    assert Knobs.from_environ({"HOROVOD_CACHE_CAPACITY": "0"}).disable_cache is True
    assert Knobs.from_environ({"HOROVOD_CACHE_CAPACITY": "1024"}).disable_cache is False


def test_knob_defaults_are_written_once_in_the_table() -> None:
    defaults = Knobs()
    for knob in KNOBS:
        value = getattr(defaults, knob.name[len("HORA_"):].lower())
        assert value == knob.default and type(value) is knob.type, knob.name
