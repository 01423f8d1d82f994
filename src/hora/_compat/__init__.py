"""Stand-ins that make existing Horovod scripts run on hora unchanged.

``hora run`` appends this directory to the workers' ``PYTHONPATH`` when no real Horovod is importable
on the host, so ``import horovod.torch as hvd`` gives hora. Nothing here is imported otherwise.
"""
