"""The benchmarks' workloads: layer shapes of real models, one table for every command."""

from __future__ import annotations

# ResNet-50 bottleneck layers: (C, K, H=W, kernel); the 3x3 convs and the 1x1 convs around them.
RESNET50_CONVS = [
    (64, 64, 56, 3),
    (256, 64, 56, 1),
    (64, 256, 56, 1),
    (128, 128, 28, 3),
    (512, 128, 28, 1),
    (128, 512, 28, 1),
    (256, 256, 14, 3),
    (1024, 256, 14, 1),
    (256, 1024, 14, 1),
    (512, 512, 7, 3),
    (2048, 512, 7, 1),
    (512, 2048, 7, 1),
]

# (N, K) of each model's linear layers: attention projections, MLP up, MLP down.
LINEAR_LAYERS = {
    "bert": [(768, 768), (3072, 768), (768, 3072)],  # BERT-base: hidden 768, MLP 3072
    "llama": [(4096, 4096), (11008, 4096), (4096, 11008)],  # LLaMA-7B: 4096, MLP 11008
}
