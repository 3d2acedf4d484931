"""Torch-free specifications of what users write: models, data, codecs, sync, batch schedules
and the compact option syntax they share."""
