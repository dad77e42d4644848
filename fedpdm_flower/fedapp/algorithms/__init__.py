"""Each algorithm's math as plain numpy functions, with the papers' equation numbers; no Flower imports."""
