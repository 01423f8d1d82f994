"""``horovod.runner.util`` on hora: ``network.get_driver_ip``."""
