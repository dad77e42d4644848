"""The reproduction app's builders: run-config keys -> the public constructors, one module per paper family.

Every algorithm key of :mod:`fedpdm_flower.fedapp.registry` builds its strategy with ``<module>:<name>_strategy(cfg)`` and its
client with ``<module>:<name>_client(cfg, context)`` -- the same keyword constructors a Flower user calls
(``strategies.*`` / ``clients.*``) -- with the model zoo and the dataset registry of :mod:`fedpdm_flower.fedapp.task`, and the
run config's seed as the devices' seed, so that runs repeat bit for bit. The app is a thin user of the public layer.
"""
