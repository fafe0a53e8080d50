"""TorchTitan 0.2.x (TOML jobs): the adapter over the shared core of ``torchtitan_ext``.

* ``config``: the ``[optimizer]`` fields DMuon adds and their parse-time checks;
* ``job``: imported by the job (``[experimental] custom_import``); installs the rest;
* ``container``: ``DMuonOptimizersContainer``, one ``DMuon`` per model part;
* ``train_specs``, ``metrics``, ``dataset``, ``routing_check``, ``cpu_compat``: what
  ``job`` installs.

Importing this package, or any module in it except ``job``, changes nothing.
"""
