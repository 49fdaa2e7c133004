"""DeepSpeed decisions in-process: the real DeepSpeed engine (ZeRO-3, CPU offload) on one gloo rank."""
import pytest
import torch

import train


def ds_engine(flags, model=None):
    import deepspeed
    args = train.parse_args(["--rollout_batch_size", "1", "--num_generations", "2", "--per_device_train_batch_size", "2",
                             *flags])
    gas = train.check_args(args, 1)
    model = model or torch.nn.Linear(4, 3)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=train.ds_config(args, gas, 1, bf16=False),
                                      lr_scheduler=train.lr_schedule(args.warmup_steps))
    return engine


def weights(engine):
    import deepspeed
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])


@pytest.mark.parametrize("warmup,rates", [(0, [0.01, 0.01, 0.01]), (4, [0.0025, 0.005, 0.0075])])
def test_each_optimizer_step_uses_the_logged_rate(world1, warmup, rates):
    """AdamW's first steps move every weight by about the learning rate (m/sqrt(v) = sign of the
    gradient), so the step's own rate is read off the weights. With WarmupLR (before) and no
    warmup, steps 1 and 2 did not move the weights at all and step 3 moved them by half."""
    torch.manual_seed(0)
    engine = ds_engine(["--learning_rate", "0.01", "--warmup_steps", str(warmup), "--weight_decay", "0"])
    x = torch.randn(2, 4)
    for rate in rates:
        logged = engine.get_lr()[0]            # what train.update logs for the step
        before = weights(engine)
        loss = engine(x).pow(2).sum()
        engine.backward(loss)
        engine.step()
        moved = (weights(engine) - before).abs()
        assert logged == pytest.approx(rate)
        assert moved.max().item() == pytest.approx(rate, rel=0.05)
