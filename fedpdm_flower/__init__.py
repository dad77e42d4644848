"""fedpdm-flower: private, communication-efficient and Byzantine-robust federated learning on Flower.

One distinctive import path for everything the wheel installs, so that a user's own ``strategies.py`` or
``clients/`` folder (Flower puts the app's directory first on ``sys.path``) can never shadow ours:

- :mod:`fedpdm_flower.strategies`: the server side (Flower Message-API strategies and wrappers);
- :mod:`fedpdm_flower.clients`: the device side (NumPyClients, mods, device privacy policies);
- :mod:`fedpdm_flower.fedapp`: the math (privacy, compression, robust rules, secure aggregation) and the
  reproduction app's Flower components.
"""

__version__ = "0.2.0"
