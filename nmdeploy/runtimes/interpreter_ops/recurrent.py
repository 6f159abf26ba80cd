"""ONNX LSTM, GRU and RNN as torch loops over the sequence, following the operators' equations in the ONNX spec.

The input products X(t) W^T of every step are one batched product before the loop (W does not depend on the
state); only H(t-1) R^T runs step by step. ``sequence_lens`` holds each row's state once its sequence has ended and
writes zeros to Y there, as ONNX Runtime does. Every step is plain torch, so gradients reach W, R, B and X.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from nmdeploy.runtimes.interpreter_ops.common import given

# name -> (function of x, alpha, beta; default alpha; default beta), the activations the recurrent ops name
_ACTIVATIONS: dict[str, tuple[Callable[[torch.Tensor, float, float], torch.Tensor], float | None, float | None]] = {
    "Sigmoid": (lambda x, a, b: torch.sigmoid(x), None, None),
    "Tanh": (lambda x, a, b: torch.tanh(x), None, None),
    "Relu": (lambda x, a, b: F.relu(x), None, None),
    "Affine": (lambda x, a, b: a * x + b, 1.0, 0.0),
    "LeakyRelu": (lambda x, a, b: F.leaky_relu(x, a), 0.01, None),
    "ThresholdedRelu": (lambda x, a, b: torch.where(x > a, x, torch.zeros_like(x)), 1.0, None),
    "ScaledTanh": (lambda x, a, b: a * torch.tanh(b * x), 1.0, 1.0),
    "HardSigmoid": (lambda x, a, b: torch.clamp(a * x + b, 0.0, 1.0), 0.2, 0.5),
    "Elu": (lambda x, a, b: F.elu(x, a), 1.0, None),
    "Softsign": (lambda x, a, b: F.softsign(x), None, None),
    "Softplus": (lambda x, a, b: F.softplus(x), None, None),
}
# op -> (gates, default activations of one direction)
_OPS = {"LSTM": (4, ("Sigmoid", "Tanh", "Tanh")), "GRU": (3, ("Sigmoid", "Tanh")), "RNN": (1, ("Tanh",))}


def _activations(op: str, attrs: dict, directions: int) -> list[list[Callable[[torch.Tensor], torch.Tensor]]]:
    """Each direction's activation functions, alphas and betas consumed in order by the functions that take them."""
    names = [n.decode() if isinstance(n, bytes) else n for n in attrs.get("activations", [])]
    names = names or list(_OPS[op][1]) * directions
    alphas, betas = list(attrs.get("activation_alpha", [])), list(attrs.get("activation_beta", []))
    functions = []
    for name in names:
        function, alpha, beta = _ACTIVATIONS[_canonical(name)]
        alpha = alphas.pop(0) if alpha is not None and alphas else alpha
        beta = betas.pop(0) if beta is not None and betas else beta
        functions.append(lambda x, f=function, a=alpha, b=beta: f(x, a, b))
    per_direction = len(functions) // directions
    return [functions[d * per_direction : (d + 1) * per_direction] for d in range(directions)]


def check_recurrent(attrs: dict, opset: int) -> str:
    # ONNX Runtime refuses batch-first recurrent ops, so nothing could check the interpreter against it there.
    if attrs.get("layout", 0):
        return "layout=1 (supported: 0, as in ONNX Runtime)"
    names = [n.decode() if isinstance(n, bytes) else n for n in attrs.get("activations", [])]
    unknown = [name for name in names if _canonical(name) not in _ACTIVATIONS]
    return f"activations={unknown} (supported: {', '.join(_ACTIVATIONS)})" if unknown else ""


def _canonical(name: str) -> str:
    return next((known for known in _ACTIVATIONS if known.lower() == name.lower()), name)


def _clipped(attrs: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    clip = attrs.get("clip")
    return (lambda x: x) if clip is None else (lambda x: torch.clamp(x, -clip, clip))


def recurrent(op: str) -> Callable[[list, dict], tuple[torch.Tensor, ...]]:
    """The op's implementation: inputs (X, W, R, B, sequence_lens, initial_h[, initial_c, P]) -> Y, Y_h[, Y_c]."""
    gates = _OPS[op][0]

    def run(inputs: list, attrs: dict) -> tuple[torch.Tensor, ...]:
        x, w, r = inputs[0], inputs[1], inputs[2]
        bias, lengths, initial_h = given(inputs, 3), given(inputs, 4), given(inputs, 5)
        initial_c = given(inputs, 6) if op == "LSTM" else None
        peephole = given(inputs, 7) if op == "LSTM" else None
        steps, batch = x.shape[0], x.shape[1]
        hidden = r.shape[-1]
        direction = attrs.get("direction", "forward")
        directions = 2 if direction == "bidirectional" else 1
        functions = _activations(op, attrs, directions)
        zeros = x.new_zeros(directions, batch, hidden)
        initial_h = zeros if initial_h is None else initial_h
        initial_c = zeros if initial_c is None else initial_c
        valid = None
        if lengths is not None:
            valid = torch.arange(steps, device=x.device).unsqueeze(1) < lengths.to(x.device).unsqueeze(0)
        sequences, finals, cells = [], [], []
        for d in range(directions):
            reverse = direction == "reverse" or d == 1
            w_bias = bias[d, : gates * hidden] if bias is not None else None
            r_bias = bias[d, gates * hidden :] if bias is not None else None
            projected = x @ w[d].T + (w_bias if w_bias is not None else 0)  # [steps, batch, gates * hidden]
            cell_peephole = peephole[d] if peephole is not None else None
            state = (initial_h[d], initial_c[d])
            outputs: list[torch.Tensor | None] = [None] * steps
            for t in reversed(range(steps)) if reverse else range(steps):
                new = _cell(op, projected[t], state, r[d], r_bias, cell_peephole, functions[d], attrs, hidden)
                if valid is not None:  # rows whose sequence has ended keep their state and output zeros
                    keep = valid[t].unsqueeze(1)
                    new = tuple(torch.where(keep, n, s) for n, s in zip(new, state, strict=True))
                    outputs[t] = torch.where(keep, new[0], torch.zeros_like(new[0]))
                else:
                    outputs[t] = new[0]
                state = new
            sequences.append(torch.stack(outputs))  # [steps, batch, hidden]
            finals.append(state[0])
            cells.append(state[1])
        y = torch.stack(sequences, dim=1)  # [steps, directions, batch, hidden]
        y_h, y_c = torch.stack(finals), torch.stack(cells)
        return (y, y_h, y_c) if op == "LSTM" else (y, y_h)

    return run


def _cell(
    op: str,
    projected: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor],
    r: torch.Tensor,
    r_bias: torch.Tensor | None,
    peephole: torch.Tensor | None,
    functions: list[Callable[[torch.Tensor], torch.Tensor]],
    attrs: dict,
    hidden: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of one direction: (H(t), C(t)); C is carried unchanged by GRU and RNN."""
    h, c = state
    clip = _clipped(attrs)
    if op == "GRU":
        f, g = functions
        r_z, r_r, r_h = r[:hidden], r[hidden : 2 * hidden], r[2 * hidden :]
        b_z, b_r, b_h = r_bias.split(hidden) if r_bias is not None else (0, 0, 0)
        x_z, x_r, x_h = projected[:, :hidden], projected[:, hidden : 2 * hidden], projected[:, 2 * hidden :]
        z = f(clip(x_z + h @ r_z.T + b_z))
        reset = f(clip(x_r + h @ r_r.T + b_r))
        if attrs.get("linear_before_reset", 0):
            candidate = g(clip(x_h + reset * (h @ r_h.T + b_h)))
        else:
            candidate = g(clip(x_h + (reset * h) @ r_h.T + b_h))
        return (1 - z) * candidate + z * h, c
    gates = projected + h @ r.T + (r_bias if r_bias is not None else 0)
    if op == "RNN":
        return functions[0](clip(gates)), c
    f, g, activation = functions
    i, o, forget, cell = gates.split(hidden, dim=1)
    if peephole is not None:
        p_i, p_o, p_f = peephole.split(hidden)
        i, forget = i + p_i * c, forget + p_f * c
    i, forget = f(clip(i)), f(clip(forget))
    if attrs.get("input_forget", 0):
        forget = 1 - i
    c = forget * c + i * g(clip(cell))
    if peephole is not None:
        o = o + p_o * c
    return f(clip(o)) * activation(c), c


OPS = {op: recurrent(op) for op in _OPS}
CHECKS = dict.fromkeys(_OPS, check_recurrent)
