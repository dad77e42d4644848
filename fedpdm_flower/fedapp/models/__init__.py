"""Model zoo: linear models over flat parameter vectors (numpy) and small torch networks."""

from typing import TYPE_CHECKING

from fedpdm_flower.fedapp.lazy import lazy_exports

if TYPE_CHECKING:
    from fedpdm_flower.fedapp.models.base import (
        LinearModel as LinearModel,
    )
    from fedpdm_flower.fedapp.models.base import (
        make_model as make_model,
    )
    from fedpdm_flower.fedapp.models.l1_logistic import (
        NonconvexL1Logistic as NonconvexL1Logistic,
    )
    from fedpdm_flower.fedapp.models.multinomial import (
        MultinomialLogistic as MultinomialLogistic,
    )

__getattr__, __all__ = lazy_exports(__name__, {
    "base": ["LinearModel", "make_model"],
    "l1_logistic": ["NonconvexL1Logistic"],
    "multinomial": ["MultinomialLogistic"],
})
