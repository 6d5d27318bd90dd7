"""The template against the same training written by hand, on one device: single, overhead,
resnet and gpt2."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import workload
from benchmarks.workload import (
    OVERHEAD_WORKLOAD,
    SGD_CONSTANT,
    WARMUP_STEPS,
    WORKLOAD,
    compose_config,
    cross_entropy,
    template_speed,
    timed_steps,
)
from src.components.data import build_data
from src.components.data_contract import Data

# The `single` comparison's workload (issue 29): MLP 784-1024-1024-10, batch 256, SGD.
SINGLE_WORKLOAD = (
    *(setting for setting in WORKLOAD if not setting.startswith(("model.", "data.", "optimizer"))),
    "model.hidden=1024",
    "model.depth=2",
    "data.input_dim=784",
    "data.num_samples=32768",
    *SGD_CONSTANT,
)


def template_single(steps: int) -> float:
    return template_speed(steps, "parallel=single", workload=SINGLE_WORKLOAD)


def template_overhead(steps: int) -> float:
    return template_speed(steps, "parallel=single", *OVERHEAD_WORKLOAD)


def plain_single(steps: int, *overrides: str) -> float:
    """The same model, data, optimizer and batch in a loop written by hand, on the template's
    device: data kept on a GPU (as the template keeps a small dataset), fused AdamW there, TF32
    matmuls (the template's default on CUDA)."""
    cfg = compose_config(*WORKLOAD, *overrides)
    data = build_data(cfg.data, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    model.to(workload.DEVICE)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optimizer.lr,
        weight_decay=cfg.optimizer.weight_decay,
        fused=workload.DEVICE == "cuda" or None,
    )
    return plain_loop(steps, model, optimizer, data, cfg.trainer.batch_size, cfg.seed)


def plain_loop(
    steps: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Data,
    batch_size: int,
    seed: int,
) -> float:
    """samples/s of a hand-written training loop over an in-memory set, on the device."""
    device = torch.device(workload.DEVICE)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    inputs, targets = data.train.inputs.to(device), data.train.targets.to(device)
    generator = torch.Generator().manual_seed(seed)
    order, position = torch.randperm(len(targets), generator=generator).to(device), 0

    def loss_of_step() -> torch.Tensor:
        nonlocal order, position
        if position + batch_size > len(targets):
            order = torch.randperm(len(targets), generator=generator).to(device)
            position = 0
        batch = order[position : position + batch_size]
        position += batch_size
        return cross_entropy(model(inputs[batch]), targets[batch])

    return timed_steps(steps, batch_size, loss_of_step, optimizer)


RESNET_BATCH_SIZE = 32
# ResNet-18 (64 wide, the CIFAR stem) with SGD on CIFAR-shaped images (3x32x32, 10 classes):
# synthetic ones, so that both sides read the same in-memory set without any files.
RESNET_WORKLOAD = (
    "model=resnet",
    "model.cifar_stem=true",
    "data=synthetic",
    "data.image_shape=[3,32,32]",
    "data.num_samples=2048",
    f"trainer.batch_size={RESNET_BATCH_SIZE}",
    *SGD_CONSTANT,
    "logger=none",
)


def template_resnet(steps: int) -> float:
    return template_speed(steps, "parallel=single", workload=RESNET_WORKLOAD)


def plain_resnet(steps: int) -> float:
    """torchvision's resnet18 given the CIFAR stem by hand (a 3x3 first convolution, no
    max-pool), as CIFAR training scripts do, with SGD, in the hand-written loop."""
    import torchvision

    cfg = compose_config(*RESNET_WORKLOAD)
    data = build_data(cfg.data, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = torchvision.models.resnet18(num_classes=data.num_classes)
    model.conv1 = torch.nn.Conv2d(3, 64, 3, padding=1, bias=False)
    model.maxpool = torch.nn.Identity()
    model.to(workload.DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.optimizer.lr, momentum=0.9)
    return plain_loop(steps, model, optimizer, data, RESNET_BATCH_SIZE, cfg.seed)


def plain_single_loader(steps: int) -> float:
    """SINGLE_WORKLOAD in a loop as a user writes it by hand: a DataLoader over a TensorDataset
    (shuffled, whole batches), SGD with the same learning rate and momentum."""
    cfg = compose_config(*SINGLE_WORKLOAD)
    device = torch.device(workload.DEVICE)
    data = build_data(cfg.data, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    model.to(device)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=cfg.optimizer.lr, momentum=cfg.optimizer.momentum
    )
    dataset = TensorDataset(data.train.inputs, data.train.targets)
    loader = DataLoader(dataset, batch_size=cfg.trainer.batch_size, shuffle=True, drop_last=True)
    batches = (batch for _ in iter(int, 1) for batch in loader)  # endless, epoch after epoch
    for step in range(steps):
        if step == WARMUP_STEPS:
            started = time.perf_counter()
        inputs, targets = next(batches)
        inputs, targets = inputs.to(device), targets.to(device)
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0:
            loss.item()
    loss.item()  # wait for the queued steps
    return (steps - WARMUP_STEPS) * cfg.trainer.batch_size / (time.perf_counter() - started)


def plain_overhead(steps: int) -> float:
    return plain_single(steps, *OVERHEAD_WORKLOAD)


def gpt2_workload() -> tuple[str, ...]:
    """On a GPU, gpt2_124m on 1024-token sequences of GPT-2's vocabulary (padded to 50304),
    batch 16, bf16 and compiled; on a CPU, a GPT of 2 blocks 128 wide on 128-token sequences,
    batch 8, fp32 and eager. AdamW with nanoGPT's GPT-2 settings, at a constant rate."""
    if workload.DEVICE == "cuda":
        shape = (
            "model=gpt2_124m",
            "data.vocab_size=50257",
            "data.seq_len=1024",
            "trainer.batch_size=16",
            "trainer.precision=bf16",
            "trainer.compile=true",
        )
    else:
        shape = (
            "model=gpt",
            "model.n_layer=2",
            "model.n_head=4",
            "model.n_embd=128",
            "data.vocab_size=512",
            "data.seq_len=128",
            "trainer.batch_size=8",
        )
    return (
        "data=synthetic_tokens",
        "task=language_model",
        "data.num_samples=1024",
        *shape,
        "optimizer=adamw",
        "optimizer.lr=6e-4",
        "optimizer.weight_decay=0.1",
        "optimizer.betas=[0.9,0.95]",
        "optimizer.schedule=constant",
        "optimizer.warmup_steps=0",
        "logger=none",
    )


def template_gpt2(steps: int) -> float:
    return template_speed(steps, "parallel=single", workload=gpt2_workload())


def plain_gpt2(steps: int) -> float:
    """The same GPT in a nanoGPT-style loop: the model and its loss compiled as one function
    (when the workload compiles), autocast, fused AdamW on a GPU with biases and norms
    undecayed, random batches of sequences held on the device, the loss read every 50 steps."""
    cfg = compose_config(*gpt2_workload())
    device = torch.device(workload.DEVICE)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    data = build_data(cfg.data, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    model.to(device)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [param for param in params if param.dim() >= 2]},
            {"params": [param for param in params if param.dim() < 2], "weight_decay": 0.0},
        ],
        lr=cfg.optimizer.lr,
        betas=tuple(cfg.optimizer.betas),
        weight_decay=cfg.optimizer.weight_decay,
        fused=device.type == "cuda" or None,
    )

    def loss_of(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())

    step_loss = torch.compile(loss_of) if cfg.trainer.compile else loss_of
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.trainer.precision)
    inputs, targets = data.train.inputs.to(device), data.train.targets.to(device)
    batch_size = cfg.trainer.batch_size

    def loss_of_step() -> torch.Tensor:
        batch = torch.randint(len(targets), (batch_size,), device=device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            return step_loss(inputs[batch], targets[batch])

    return timed_steps(steps, batch_size, loss_of_step, optimizer)
