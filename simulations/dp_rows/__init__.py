"""Rows of ``bench --suite dp-seeds`` (:mod:`simulations.dp_seeds`): one module per algorithm family, each defining
``ROWS: list[simulations.dp_seeds.Row]``; every module here is picked up, in name order."""
