"""``hora.run(fn)``: a Python function run on every rank, its shipping, and the worker that calls it."""
