"""The one run loop every driver is (launcher/supervision/loop.py): each driver only defines steps."""

from __future__ import annotations

import signal
from collections.abc import Iterable
from typing import Any

import pytest

from hora.launcher.config import RunConfig
from hora.launcher.elastic.driver import ElasticDriver
from hora.launcher.fixed.driver import Driver
from hora.launcher.hosts import SlotInfo, parse_hosts
from hora.launcher.supervision.loop import Handle, JobLoop
from hora.launcher.supervision.root_cause import RankState

SHARED = ("run", "_loop", "_handle", "_on_signal", "_on_interrupt", "stop_all", "kill_all", "_shut_down",
          "_exit_status", "agent_spec", "start_agent", "start_store", "watch", "stopping")


@pytest.mark.parametrize("driver", [Driver, ElasticDriver])
def test_both_drivers_are_the_one_loop_with_their_own_steps(driver: type[JobLoop]) -> None:
    assert issubclass(driver, JobLoop) and driver.__mro__[1] is JobLoop  # no chain of driver classes
    assert [name for name in SHARED if name in vars(driver)] == []
    assert not getattr(driver, "__abstractmethods__", None)


class _OneProcess(JobLoop):
    """A job of one process that ends when the test says so (an ``exit`` event), no agent."""

    noun = "worker"

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg, transport_for=lambda host, local: None)  # type: ignore[arg-type,return-value]
        self.state = RankState(SlotInfo(0, 1, 0, 1, 0, 1, "localhost", 0))
        self.looks = 0

    def set_up(self) -> None:
        return None

    def look(self, now: float) -> None:
        self.looks += 1

    def over(self) -> bool:
        return self.state.done

    def wait_s(self) -> float:
        return 0.01

    def on_message(self, handle: Handle, message: dict[str, Any]) -> None:
        raise AssertionError("no agent")

    def on_handle_gone(self, handle: Handle, code: int) -> None:
        raise AssertionError("no agent")

    def on_event(self, kind: str, value: Any) -> None:
        if kind == "exit":
            self.state.done, self.state.code, self.state.stopped = True, 1, True

    def processes(self) -> Iterable[RankState]:
        return [self.state]

    def killed_label(self, state: RankState) -> str:
        return "worker 0"

    def failed_status(self) -> int | None:
        return None


def test_a_signal_stops_the_job_and_the_exit_status_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    job = _OneProcess(RunConfig(command=("python", "x.py"), np=1, hosts=parse_hosts("localhost:1")))
    job.events.put(("signal", -1, signal.SIGINT))
    job.events.put(("exit", -1, None))
    assert job.run() == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert "interrupted (SIGINT): stopping 1 worker(s) (SIGTERM, SIGKILL after" in err, err
    assert "stopped after SIGINT: no worker is running; exit code 130" in err, err


def test_the_cluster_frameworks_drivers_override_no_private_step() -> None:
    """hora.ray's and hora.spark's drivers are hora run's drivers with public steps of their own (where the store
    listens, how workers start, where a rank runs): none of the loop's or the driver's private methods is
    redefined, and the actors are a handle of their own, not an agent's handle without a process."""
    pytest.importorskip("ray")
    from hora.launcher.remote.agent_handle import AgentHandle
    from hora.ray.actors import RayActors
    from hora.ray.elastic import RayElasticDriver
    from hora.ray.executor import RayRun
    from hora.spark.runner import SparkRun

    for framework_driver, driver in ((RayElasticDriver, ElasticDriver), (RayRun, Driver), (SparkRun, Driver)):
        assert framework_driver.__mro__[1] is driver
        redefined = [name for name in vars(framework_driver) if name.startswith("_") and not name.startswith("__")
                     and name != "_abc_impl"
                     and (name in vars(driver) or name in vars(JobLoop))]
        assert redefined == [], framework_driver
    assert AgentHandle not in RayActors.__mro__
