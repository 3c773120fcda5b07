"""Measuring with torch, on the device that will train: a model block by block
(``model``), this machine's collectives (``collectives``, ``hardware``), and the cache every
command reads profiles through (``cache``). What is measured is ``predict.profiles``'s
dataclasses: this layer depends on the cost model, never the other way round."""
