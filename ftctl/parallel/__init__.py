"""Parallel backends behind one interface (:class:`ftctl.parallel.base.Backend`).

A backend knows the process group (rank, world size, device) and wraps the model and optimizer
into an :class:`ftctl.parallel.base.Engine`, through which the runner does backward, the optimizer
step and the gathering of weights for saving. The runner never asks which backend it has.

The factory is :func:`ftctl.parallel.backends.create_backend`. This package's init imports nothing, so
config validation reads the torch-free rules of :mod:`ftctl.parallel.support` without reaching up to
the backends, which import the config layer.
"""
