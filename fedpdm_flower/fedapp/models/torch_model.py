"""A user's torch ``nn.Module`` seen as the flat vector x of :class:`fedpdm_flower.fedapp.layout.ArrayLayout`.

The layout is the module's ``state_dict`` order, so ``ArrayRecord(net.state_dict())`` on the server and this
adapter on the client agree on what coordinate j of x is. What x holds depends on ``buffers``:

* ``"beside"`` (default): x is the module's floating-point **parameters**; its buffers -- BatchNorm's running
  statistics and ``num_batches_tracked``, any registered buffer -- are state beside x (:meth:`TorchModel.get_buffers`
  / :meth:`TorchModel.set_buffers`): the forward passes of training update them as the module's own code says, the
  algorithm never moves them, and they travel in their own record (:mod:`fedpdm_flower.clients.base`);
* ``"in-vector"``: floating-point buffers are coordinates of x too (FedREP's w, spec 11.2), integer buffers are
  carried beside.

Two views of training, for the two kinds of local solver in this project:

* **numpy-style** (FedPDM, the local-SGD baselines, IADMM, DPQ-DSGD): :meth:`TorchModel.grad` loads x into the
  module and returns the flat gradient of the user's loss on a mini-batch as a float64 numpy vector (zeros on any
  buffer coordinate of x: a buffer is not a trained variable). The solver does its arithmetic on x;
* **in-place** (FedREP's momentum SGD): :meth:`batch_gradient` / :meth:`add_to_trainable` work on the module's
  parameters directly (torch tensors over the trainable entries, in state-dict order), and :meth:`get_flat` reads
  the result back -- including buffers that the forward passes updated when they are in x.

The model is the user's; we never change its architecture, and it stays on the device the user put it on (CPU,
CUDA, ...): the batches are moved to it, the flat vector is read back to the host. Tied (shared) parameters appear
twice in a state dict and are refused with a clear error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from fedpdm_flower.fedapp.layout import ArrayLayout, FloatArray

__all__ = ["BUFFER_MODES", "TorchModel"]

#: where a model's floating-point buffers live: beside x (default) or in it (FedREP)
BUFFER_MODES = ("beside", "in-vector")


def module_device(module: nn.Module) -> torch.device:
    """The device of the module's first parameter (or buffer); CPU for a module with neither."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def _to_tensor(value: Any, device: torch.device, *, floating: bool) -> torch.Tensor:
    """A batch as a tensor on ``device``; float64 numpy inputs become float32 (torch's default parameter dtype)."""
    if isinstance(value, torch.Tensor):
        t = value
    else:
        arr = np.asarray(value)
        if floating and arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        elif not arr.flags.writeable:  # torch refuses to wrap read-only memory (e.g. a memory-mapped dataset)
            arr = arr.copy()
        t = torch.from_numpy(np.ascontiguousarray(arr))
    return t.to(device)


class TorchModel:
    """The flat-vector interface (``dim``, ``grad``, ``loss``, ``accuracy``) over a torch module.

    Parameters
    ----------
    module
        The user's network. Its current weights are the client's starting point until a message sets them.
    loss_fn
        ``loss_fn(outputs, targets) -> scalar tensor`` with mean reduction over the batch (default
        ``nn.CrossEntropyLoss()``). The DP sensitivities of this project bound the norm of this loss's gradient by
        clipping; any differentiable loss works.
    device
        Where the forward and backward passes run. None (default): where the module already is (the device of its
        first parameter); the module is not moved. A device moves the module there.
    eval_batch
        Samples per forward pass in :meth:`loss` / :meth:`accuracy` (default 1024).
    input_transform
        Optional map applied to each input batch before the forward pass (e.g. reshaping flat features).
    buffers
        ``"beside"`` (default): x holds the parameters only, buffers are state beside it; ``"in-vector"``: the
        floating-point buffers are coordinates of x too (module docstring).
    """

    def __init__(
        self,
        module: nn.Module,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        *,
        device: str | torch.device | None = None,
        eval_batch: int = 1024,
        input_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        buffers: str = "beside",
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"expected a torch nn.Module, got {type(module).__name__}")
        if buffers not in BUFFER_MODES:
            raise ValueError(f"buffers must be one of {list(BUFFER_MODES)}, got {buffers!r}")
        if device is None:  # the user's device: the module stays where it is
            self.device, self.module = module_device(module), module
        else:
            self.device = torch.device(device)
            self.module = module.to(self.device)
        self.loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        self.eval_batch = int(eval_batch)
        self.input_transform = input_transform
        state = module.state_dict(keep_vars=True)
        seen: dict[int, str] = {}
        for name, t in state.items():
            key = id(t)
            if key in seen:
                raise ValueError(f"state-dict entries {seen[key]!r} and {name!r} are the same (tied) tensor: "
                                 "tied parameters are not supported, untie them or train one copy")
            seen[key] = name
        #: floating-point buffers (BatchNorm running statistics): data-dependent state outside the gradient
        self.buffer_names = [k for k, t in state.items()
                             if not isinstance(t, nn.Parameter) and torch.is_floating_point(t)]
        self.buffers_mode = buffers
        self.layout = ArrayLayout.of({k: v.detach().cpu().numpy() for k, v in state.items()},
                                     beside=self.buffer_names if buffers == "beside" else ())
        # (tensor, slice of x) for every entry of x, in layout order
        self._slots = [(state[e.name], slice(e.offset, e.offset + e.size))
                       for e in self.layout.entries if e.offset is not None]
        self._params = [t for t, _ in self._slots if isinstance(t, nn.Parameter)]
        self._param_slices = [s for t, s in self._slots if isinstance(t, nn.Parameter)]
        self.num_trainable = sum(p.numel() for p in self._params)
        #: the mean loss of the last records :meth:`per_sample_grads` / :meth:`clipped_grad_sum` saw (nan before)
        self.last_batch_loss = float("nan")
        self._psg: tuple[dict[str, torch.Tensor], Any] | None = None  # the vmapped per-sample gradient function
        #: the state-dict entries beside x (buffers and integer entries), by name
        self._beside = {e.name: state[e.name] for e in self.layout.entries if not e.in_vector}

    @property
    def dim(self) -> int:
        """d: the floating-point entries of the state dict."""
        return self.layout.dim

    @property
    def has_float_buffers(self) -> bool:
        """True when the module has floating-point buffers (e.g. BatchNorm running statistics)."""
        return bool(self.buffer_names)

    # ------------------------------------------------------------------ state beside x
    @property
    def beside_names(self) -> list[str]:
        """The state-dict entries beside x (buffers, integer entries), in state-dict order."""
        return list(self._beside)

    def get_buffers(self) -> dict[str, NDArray[Any]]:
        """The entries beside x as numpy arrays (copies, on the host), in state-dict order."""
        return {k: t.detach().cpu().numpy().copy() for k, t in self._beside.items()}

    def set_buffers(self, arrays: Mapping[str, NDArray[Any]]) -> None:
        """Load the entries beside x (all of them, by name) into the module, cast to each tensor's dtype.

        Raises ValueError naming the entry for a missing or unknown name, a wrong shape or a non-finite value (the
        arrays come from a message: untrusted).
        """
        names = list(arrays)
        if sorted(names) != sorted(self._beside):
            missing = sorted(set(self._beside) - set(names))
            extra = sorted(set(names) - set(self._beside))
            raise ValueError(f"the model's buffers are {list(self._beside)[:6]}; got {names[:6]} (missing {missing}, "
                             f"unknown {extra})")
        values = {}
        for name, t in self._beside.items():
            a = np.asarray(arrays[name])
            if tuple(a.shape) != tuple(t.shape):
                raise ValueError(f"buffer {name!r} has shape {tuple(a.shape)}, the model's {tuple(t.shape)}")
            if a.dtype == object or (not np.issubdtype(a.dtype, np.number) and a.dtype != np.bool_):
                raise ValueError(f"buffer {name!r} has dtype {a.dtype}: not numeric")
            if not np.all(np.isfinite(a)):
                raise ValueError(f"buffer {name!r} holds NaN or infinite values")
            if not torch.is_floating_point(t) and np.issubdtype(a.dtype, np.floating):
                a = np.rint(a)  # a mean of integer counters: the nearest integer
            values[name] = a
        with torch.no_grad():
            for name, t in self._beside.items():
                src = torch.from_numpy(np.ascontiguousarray(values[name])).reshape(t.shape)
                t.copy_(src.to(device=t.device, dtype=t.dtype))

    # ------------------------------------------------------------------ flat vector <-> module
    def state_arrays(self) -> dict[str, NDArray[Any]]:
        """The module's state dict as numpy arrays (what ``ArrayRecord(net.state_dict())`` holds)."""
        return {k: v.detach().cpu().numpy().copy() for k, v in self.module.state_dict().items()}

    def get_flat(self) -> FloatArray:
        """x: the module's floating-point state as a float64 copy."""
        with torch.no_grad():
            return torch.cat([t.detach().reshape(-1).double().cpu() for t, _ in self._slots]).numpy()

    def set_flat(self, x: NDArray[Any], *, buffers: bool = True) -> None:
        """Load x into the module (cast to each tensor's dtype); ``buffers=False`` leaves the buffers as they are."""
        vec = np.asarray(x)
        if vec.shape != (self.dim,):
            raise ValueError(f"parameter vector has shape {vec.shape}, expected ({self.dim},)")
        src = torch.from_numpy(np.ascontiguousarray(vec))
        with torch.no_grad():
            for t, s in self._slots:
                if buffers or isinstance(t, nn.Parameter):
                    t.copy_(src[s].view_as(t))

    def init(self, rng: np.random.Generator, std: float = 0.0) -> FloatArray:
        """torch's default initialisation of every submodule, seeded from ``rng`` (``std`` is unused)."""
        torch.manual_seed(int(rng.integers(0, 2**31 - 1)))
        for m in self.module.modules():
            reset = getattr(m, "reset_parameters", None)
            if m is not self.module and callable(reset):
                reset()
        return self.get_flat()

    # ------------------------------------------------------------------ data
    def inputs(self, features: Any) -> torch.Tensor:
        """A batch of inputs as a float tensor on the device (``input_transform`` applied)."""
        x = _to_tensor(features, self.device, floating=True)
        return self.input_transform(x) if self.input_transform is not None else x

    def targets(self, labels: Any) -> torch.Tensor:
        """A batch of targets as a tensor on the device (integer class labels become int64)."""
        t = _to_tensor(labels, self.device, floating=True)
        return t.long() if not torch.is_floating_point(t) else t

    # ------------------------------------------------------------------ in-place training primitives
    def batch_gradient(self, features: Any, labels: Any) -> tuple[torch.Tensor, float]:
        """Gradient of the loss over the trainable entries (state-dict order) at the module's current weights,
        in train mode (BatchNorm uses batch statistics and updates its running buffers), and the batch loss."""
        self.module.train()
        self.module.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.module(self.inputs(features)), self.targets(labels))
        loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        return torch.cat([g.reshape(-1) for g in grads]).cpu(), float(loss.item())

    def load_grads(self, g: NDArray[Any]) -> None:
        """Set every trainable parameter's ``.grad`` from a flat d-vector (state-dict order; buffer entries are
        ignored), so that a torch optimizer steps on a gradient computed elsewhere (e.g. DP-SGD's noisy one)."""
        vec = np.asarray(g)
        if vec.shape != (self.dim,):
            raise ValueError(f"gradient vector has shape {vec.shape}, expected ({self.dim},)")
        with torch.no_grad():
            for p, s in zip(self._params, self._param_slices, strict=True):
                p.grad = torch.from_numpy(np.ascontiguousarray(vec[s])).view_as(p).to(p.device, p.dtype)

    def add_to_trainable(self, delta: torch.Tensor) -> None:
        """Trainable entries += delta (in place)."""
        with torch.no_grad():
            off = 0
            for p in self._params:
                n = p.numel()
                p.add_(delta[off:off + n].view_as(p).to(p.device, p.dtype))
                off += n

    # ------------------------------------------------------------------ numpy-style interface
    def grad(self, x: NDArray[Any], features: Any, labels: Any) -> FloatArray:
        """Flat gradient (float64, d entries, zeros on buffers) of the mini-batch loss at x."""
        self.set_flat(x, buffers=False)
        g, _ = self.batch_gradient(features, labels)
        out = np.zeros(self.dim)
        gn = g.double().numpy()
        off = 0
        for s in self._param_slices:
            n = s.stop - s.start
            out[s] = gn[off:off + n]
            off += n
        return out

    def _per_sample_torch(self, x: NDArray[Any], features: Any, labels: Any) -> dict[str, torch.Tensor]:
        """{parameter name: (B, *shape) tensor}: each record's gradient at x, by ``torch.func`` (vmap of grad).
        The records' mean loss is kept in :attr:`last_batch_loss` (a diagnostic)."""
        self.set_flat(x, buffers=False)
        if not self.module.training:
            self.module.train()
        if self._psg is None:  # built once: the detached tensors share the parameters' storage, set_flat updates them
            from torch.func import functional_call, grad_and_value, vmap

            params = {k: p.detach() for k, p in self.module.named_parameters()}
            buffers = {k: b.detach() for k, b in self.module.named_buffers()}

            def sample_loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
                out = functional_call(self.module, (p, buffers), (xi.unsqueeze(0),))
                return self.loss_fn(out, yi.unsqueeze(0))

            self._psg = (params, vmap(grad_and_value(sample_loss), in_dims=(None, 0, 0), randomness="different"))
        params, fn = self._psg
        grads, losses = fn(params, self.inputs(features), self.targets(labels))
        self.last_batch_loss = float(losses.mean())
        return grads  # type: ignore[no-any-return]

    def per_sample_grads(self, x: NDArray[Any], features: Any, labels: Any) -> FloatArray:
        """Gradient of the loss of each sample at x, shape (n, d), float64, zeros on buffer coordinates.

        Row i is the gradient of ``loss_fn`` on sample i alone (a batch of one), computed for all samples at once
        with ``torch.func.vmap``; what DP mechanisms that clip every sample's gradient need. Train mode, as
        :meth:`grad`; dropout draws a different mask per sample. Memory is n x d: callers pass chunks, or use
        :meth:`clipped_grad_sum`.
        """
        grads = self._per_sample_torch(x, features, labels)
        n = len(next(iter(grads.values()))) if grads else 0
        out = np.zeros((n, self.dim))
        for name, s in self.layout.slices().items():
            if name in grads:  # parameters only: a buffer is not a trained variable
                out[:, s] = grads[name].reshape(n, -1).double().cpu().numpy()
        return out

    def clipped_grad_sum(self, x: NDArray[Any], features: Any, labels: Any, clip: float) -> FloatArray:
        """``sum_i min(1, clip / ||g_i||) g_i`` over the samples (DP-SGD's clipped sum), float64 over the d entries.

        The per-sample gradients stay in torch (no (n, d) float64 matrix): their norms are summed over the
        parameters, the clip factors applied with one einsum per parameter.
        """
        out = np.zeros(self.dim)
        if len(labels) == 0:
            return out
        grads = self._per_sample_torch(x, features, labels)
        first = next(iter(grads.values()))
        sq = torch.zeros(len(first), dtype=first.dtype, device=first.device)
        for g in grads.values():
            sq = sq + g.reshape(len(g), -1).pow(2).sum(dim=1)
        factor = torch.clamp(clip / torch.sqrt(sq).clamp_min(torch.finfo(sq.dtype).tiny), max=1.0)
        for name, s in self.layout.slices().items():
            if name in grads:
                g = grads[name]
                out[s] = torch.einsum("b,bk->k", factor, g.reshape(len(g), -1)).double().cpu().numpy()
        return out

    def _outputs(self, x: NDArray[Any], features: Any) -> torch.Tensor:
        self.set_flat(x)
        self.module.eval()
        inputs = self.inputs(features)
        with torch.no_grad():
            return torch.cat([self.module(inputs[i:i + self.eval_batch]) for i in range(0, len(inputs), self.eval_batch)])

    def evaluate(self, x: NDArray[Any], features: Any, labels: Any) -> tuple[float, float]:
        """(accuracy, loss) of x in eval mode with one forward pass (accuracy: argmax of the outputs)."""
        out = self._outputs(x, features)
        y = self.targets(labels)
        loss = float(self.loss_fn(out, y))
        acc = float((out.argmax(dim=1) == y).double().mean()) if out.dim() == 2 and not torch.is_floating_point(y) else float("nan")
        return acc, loss

    def evaluate_chunks(self, x: NDArray[Any] | None, chunks: Iterable[tuple[Any, Any]]) -> tuple[float, float, int]:
        """(accuracy, mean loss, samples) in eval mode over ``(inputs, targets)`` chunks, holding one chunk at a time.

        x None evaluates the module's current weights. The loss is ``loss_fn``'s mean of each chunk weighted by its
        size; the accuracy is NaN unless every chunk is a classification (2-d outputs, integer targets).
        """
        if x is not None:
            self.set_flat(x)
        self.module.eval()
        loss_sum, correct, n, classify = 0.0, 0, 0, True
        with torch.no_grad():
            for features, labels in chunks:
                out, y = self.module(self.inputs(features)), self.targets(labels)
                m = len(y)
                loss_sum += float(self.loss_fn(out, y)) * m
                if out.dim() == 2 and not torch.is_floating_point(y):
                    correct += int((out.argmax(dim=1) == y).sum())
                else:
                    classify = False
                n += m
        if n == 0:
            raise ValueError("no samples to evaluate on")
        return (correct / n if classify else float("nan")), loss_sum / n, n

    def loss(self, x: NDArray[Any], features: Any, labels: Any) -> float:
        """Mean loss of x on the given samples (eval mode)."""
        return self.evaluate(x, features, labels)[1]

    def accuracy(self, x: NDArray[Any], features: Any, labels: Any) -> float:
        """Top-1 accuracy of x on the given samples (eval mode); NaN for non-classification targets."""
        return self.evaluate(x, features, labels)[0]
