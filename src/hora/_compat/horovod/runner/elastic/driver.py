"""``horovod.runner.elastic.driver`` on hora: hora's elastic driver module itself (:mod:`hora.launcher.elastic.driver`),
so setting ``DISCOVER_HOSTS_FREQUENCY_SECS`` here changes how often hora's driver looks for hosts."""

from __future__ import annotations

import sys

from hora.launcher.elastic import driver as _driver

sys.modules[__name__] = _driver
