"""Server side of each algorithm: one Flower Message-API Strategy module per paper / baseline."""
