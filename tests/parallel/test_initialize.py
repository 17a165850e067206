"""Process-group set-up and tear-down: one process builds several models in turn (the stability benchmark's and
the drift sweep's runs), so shutdown must leave none of megatron's per-model global state behind."""

import torch

from tests.distributed import run_distributed


def _aux_loss_models_of_two_depths():
    from megatron_gspo.models.build import build_model
    from megatron_gspo.models.config import preset
    from megatron_gspo.models.router import set_aux_loss_weight
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown

    losses = []
    for layers in (2, 3):  # the aux-loss tracker of the 2-layer model must not meet the 3-layer one
        initialize(ParallelConfig(), seed=0)
        try:
            cfg = preset(
                "tiny",
                num_hidden_layers=layers,
                hidden_size=32,
                num_attention_heads=2,
                head_dim=16,
                num_key_value_heads=1,
                moe_intermediate_size=16,
                router_aux_loss_coef=0.01,
            )
            (model,) = build_model(cfg, ParallelConfig())
            model.train()
            set_aux_loss_weight([model], 1.0)  # what engine.forward_backward sets for a real step
            ids = torch.randint(0, cfg.vocab_size, (2, 6))
            logits = model(ids, torch.arange(6).expand(2, -1), None)
            logits.float().sum().backward()  # the router's aux loss is attached and tracked in training forwards
            losses.append(float(logits.float().sum()))
        finally:
            shutdown()
    return losses


def test_models_of_different_depths_with_aux_loss_in_one_process():
    # Before the fix: IndexError in megatron's save_to_aux_losses_tracker (sized 2 by the first model).
    losses = run_distributed(_aux_loss_models_of_two_depths, world_size=1)[0]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
