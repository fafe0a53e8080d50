"""TorchTitan 0.2.x (TOML jobs): the adapter over the shared core of ``torchtitan_ext``.

* ``config``: the ``[optimizer]`` fields DMuon adds;
* ``kwargs``: what those fields make, ``DMuon``'s keyword arguments (and their TOML spellings);
* ``validation``: the fields' parse-time checks, run by TorchTitan's ``ConfigManager``;
* ``job``: imported by the job (``[experimental] custom_import``); installs the rest;
* ``container``: ``DMuonOptimizersContainer``, one ``DMuon`` per model part;
* ``train_specs``, ``metrics``, ``dataset``, ``routing_check``, ``cpu_compat``: what
  ``job`` installs.

Importing this package, or any module in it except ``job``, changes nothing.
"""
