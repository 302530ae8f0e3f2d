"""Numeric precision: ``auto`` (the torch-free rule of what it means on a machine) and ``policy``
(the autocast context, the loss scaler and master weights of a run)."""
