from __future__ import annotations

import pathlib

import pytest

from hora.common.knobs import KNOBS, Knobs, knobs_markdown
from hora.errors import ConfigError

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "knobs.md"


def test_docs_list_every_knob_as_generated() -> None:
    text = DOC.read_text()
    assert text.endswith(knobs_markdown()), "docs/knobs.md is stale: run python scripts/gen_knobs_doc.py"
    for knob in KNOBS:
        assert f"`{knob.name}`" in text


def test_horovod_aliases_and_hora_names_are_read() -> None:
    knobs = Knobs.from_environ({"HOROVOD_STALL_CHECK_TIME_SECONDS": "7", "HORA_FUSION_THRESHOLD": "1024",
                                "HOROVOD_CACHE_CAPACITY": "0", "HORA_TIMELINE_MARK_CYCLES": "yes"})
    assert knobs.stall_check_time_seconds == 7.0
    assert knobs.fusion_threshold == 1024
    assert knobs.disable_cache is True
    assert knobs.timeline_mark_cycles is True


def test_hora_name_wins_over_horovod_alias() -> None:
    knobs = Knobs.from_environ({"HOROVOD_STALL_CHECK_TIME_SECONDS": "7", "HORA_STALL_CHECK_TIME_SECONDS": "3"})
    assert knobs.stall_check_time_seconds == 3.0


@pytest.mark.parametrize(("name", "raw"), [("HORA_FUSION_THRESHOLD", "lots"), ("HORA_STALL_CHECK_DISABLE", "maybe")])
def test_bad_values_name_the_variable(name: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=name):
        Knobs.from_environ({name: raw})
