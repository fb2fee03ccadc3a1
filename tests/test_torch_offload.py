"""Optimizer offload in the torch runtime (runtime_adapters/offload.py), in one process; the multi-rank cases
(FSDP2 ZeRO-3 shards, TP shards, one grid, a checkpoint resume) are in tests/test_torch_stage_grids.py."""
from __future__ import annotations

import torch
from torch import nn

from runtime_adapters.offload import HostOffloadOptimizer


def _adam(params):
    return torch.optim.AdamW(params, lr=1e-2, foreach=False)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _train(model, opt, steps=3):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(5, 8, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_offloaded_adam_equals_adam_and_keeps_its_state_off_the_module():
    ref, off = _model(), _model()
    _train(ref, _adam(ref.parameters()))
    opt = HostOffloadOptimizer(off.parameters(), _adam)
    _train(off, opt)
    for a, b in zip(ref.parameters(), off.parameters()):
        torch.testing.assert_close(a, b)
    module_params = {id(p) for p in off.parameters()}
    assert opt.state and all(id(p) not in module_params for p in opt.state)  # state keyed by the host copies
    assert all(s["exp_avg"].device == opt.host for s in opt.state.values())
    assert all(p.grad is None for p in off.parameters())


def test_a_loaded_parameter_is_not_undone_by_the_next_step():
    """load_state_dict (a checkpoint resume loads the module, then the optimizer) re-reads the master copies."""
    model = _model()
    opt = HostOffloadOptimizer(model.parameters(), _adam)
    _train(model, opt, steps=1)
    saved = opt.state_dict()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)  # what loading a checkpoint's parameters does in place
    opt.load_state_dict(saved)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.param_groups[0]["lr"] = 0.0  # an LR schedule acts on the groups: no update, parameters stay loaded
    opt.step()
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in model.parameters())
