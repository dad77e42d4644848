"""Model zoo: linear models over flat parameter vectors (numpy) and small torch networks."""

from fedapp.models.base import LinearModel, make_model
from fedapp.models.l1_logistic import NonconvexL1Logistic
from fedapp.models.multinomial import MultinomialLogistic

__all__ = ["LinearModel", "MultinomialLogistic", "NonconvexL1Logistic", "make_model"]
