"""The models, built the same way for every strategy: the CIFAR-10 CNN and the MNIST net of the
workshop, and ResNet-50 (or any torchvision classification model) for TinyImageNet.

``build_model(name, num_classes, input_shape)`` returns a fresh model; the caller seeds torch
first, so every rank builds the same weights.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from training.faults import UsageError


class CifarCNN(nn.Module):
    """The small CIFAR-10 CNN. No BatchNorm and no dropout: a step depends only on the batch,
    so runs are exactly comparable across world sizes."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * 8 * 8, 256),
                                        nn.ReLU(inplace=True), nn.Linear(256, num_classes))

    def forward(self, x):
        # Only the image shape is checked: the batch size differs between ranks and in the
        # last batch.
        assert x.shape[1:] == (3, 32, 32), f"cnn expects 3x32x32 images, got {tuple(x.shape[1:])}"
        return self.classifier(self.features(x))


class MnistNet(nn.Module):
    """The MNIST net of the workshop (two convolutions, dropout, two linear layers)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x):
        assert x.shape[1:] == (1, 28, 28), f"mnist_net expects 1x28x28, got {tuple(x.shape[1:])}"
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = torch.flatten(self.dropout1(x), 1)
        return self.fc2(self.dropout2(F.relu(self.fc1(x))))  # logits for CrossEntropyLoss


def synthetic_shape(model_name: str) -> tuple:
    """Synthetic data is shaped for the model: (input shape, number of classes)."""
    if model_name == "cnn":
        return (3, 32, 32), 10
    if model_name == "mnist_net":
        return (1, 28, 28), 10
    return (3, 64, 64), 200


def grey_channels(model_name: str) -> int:
    """How many channels a grey dataset (Fashion-MNIST) hands this model: one for mnist_net,
    which was made for grey images; three for every other model, the grey channel repeated, so
    a torchvision classifier such as resnet18 trains on it unchanged."""
    return 1 if model_name == "mnist_net" else 3


def check_model(name: str, shape: tuple) -> None:
    """Reject a model that cannot take the dataset's images, naming a model that can."""
    shown = "x".join(map(str, shape))
    if name == "cnn" and tuple(shape) != (3, 32, 32):
        raise UsageError(f"--model cnn takes 3x32x32 images (cifar10 or synthetic), not "
                         f"{shown}: choose --model "
                         f"{'mnist_net' if tuple(shape[1:]) == (28, 28) else 'resnet50'}")
    if name == "mnist_net" and tuple(shape) != (1, 28, 28):
        raise UsageError(f"--model mnist_net takes 1x28x28 images (mnist, fashion-mnist or "
                         f"synthetic), not {shown}: choose another --model")
    if name in ("cnn", "mnist_net"):
        return
    # torchvision is imported here, where ResNet needs it: cnn and mnist_net need none of it
    from torchvision import models
    if name not in models.list_models(module=models):
        raise UsageError(f"unknown --model {name!r}: use resnet50, cnn, mnist_net or a "
                         f"torchvision classification model such as resnet18 or "
                         f"mobilenet_v3_small")
    if shape[0] != 3:
        raise UsageError(f"--model {name} takes 3-channel images and this dataset has "
                         f"{shape[0]}: use --model mnist_net for MNIST")


def memory_format(model: nn.Module, device: torch.device) -> torch.memory_format:
    """channels_last for a conv net on CUDA (cuDNN's faster convolutions, above all with
    AMP), the default (contiguous) memory format otherwise. The scripts put the model and the
    batches in it."""
    conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    return torch.channels_last if device.type == "cuda" and conv else torch.contiguous_format


def _refusal(model: nn.Module, input_shape: tuple) -> Exception | None:
    """Why ``model`` (in eval mode) refuses one image of ``input_shape``, or None."""
    try:
        with torch.no_grad():
            model(torch.zeros(1, *input_shape))
    except (AssertionError, RuntimeError, ValueError) as err:
        return err
    return None


def watch_batchnorms(model: nn.Module, single: list) -> list:
    """Hooks (remove them after one forward) that append to ``single`` the name of each
    BatchNorm of ``model`` whose input holds one value per channel of an image: a 1x1 feature
    map, or a BatchNorm1d's (batch, features)."""
    def watch(where):
        def hook(module, inputs):
            if inputs[0][0, 0].numel() == 1:
                single.append(where)
        return hook
    return [module.register_forward_pre_hook(watch(where))
            for where, module in model.named_modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm)]


# torchvision's classifiers whose training-mode output is a tuple with auxiliary logits
AUXILIARY_HEADS = ("googlenet", "inception_v3")


def loading_options(name: str) -> dict:
    """The options of torchvision's builder under which a model of ``name`` takes the weights
    these scripts trained: GoogLeNet and Inception v3 without their auxiliary heads, which
    build_model leaves out, and without their initialisation, which the weights replace."""
    return {"aux_logits": False, "init_weights": False} if name in AUXILIARY_HEADS else {}


def build_model(name: str, num_classes: int, input_shape: tuple,
                batch: int | None = None) -> nn.Module:
    """A fresh model; the caller seeds torch first so every rank builds the same weights.
    ``batch``: the images one replica trains on per step (the scripts' --batch-size), which
    a BatchNorm that sees a 1x1 feature map needs to be at least 2 (checked when given)."""
    check_model(name, input_shape)
    if name == "cnn":
        return CifarCNN(num_classes)
    if name == "mnist_net":
        return MnistNet(num_classes)
    from torchvision import models  # imported here, as in check_model
    options = {}
    if name.startswith(("resnet", "resnext", "wide_resnet")):
        # ResNets: each residual block starts as the identity (its last BatchNorm's weight at
        # 0), the initialisation of Goyal et al. (2017) that --lr-scaling follows. Without it,
        # after a few dozen steps BatchNorm's running statistics are still far from the
        # batches' and evaluation multiplies the mismatch through every block: the synthetic
        # demo's validation loss was 208-256 after its first epoch, against 5.3 (ln 200) at
        # chance; with it, 5.26.
        options = {"zero_init_residual": True}
    if name in AUXILIARY_HEADS:
        # GoogLeNet and Inception v3 come with auxiliary classifiers, whose outputs they return
        # beside the logits in training mode, for a weighted extra loss these scripts do not
        # compute: built without them, they return logits as every other model does.
        # init_weights=True is their current initialisation, said so to silence their warning.
        options = loading_options(name) | {"init_weights": True}
    model = models.get_model(name, weights=None, num_classes=num_classes, **options)
    # One image through the model, no state changed: some models take one image size only
    # (ViT: 224x224), and this says so before any training starts. It also finds the
    # BatchNorms that see one value per channel of an image (a 1x1 feature map).
    single = []
    hooks = watch_batchnorms(model, single)
    try:
        err = _refusal(model.eval(), input_shape)
    finally:
        for hook in hooks:
            hook.remove()
    if err is not None:
        shown = "x".join(map(str, input_shape))
        size = getattr(model, "image_size", None)  # a ViT's one image size
        if not isinstance(size, int) and _refusal(model, (input_shape[0], 224, 224)) is None:
            size = 224  # Inception v3 takes 75 px or more: not TinyImageNet's 64
        fix = (f"add --image-size {size} (synthetic or TinyImageNet data) or choose --model "
               f"resnet50" if isinstance(size, int) else "choose --model resnet50")
        raise UsageError(f"--model {name} cannot take this dataset's {shown} images "
                         f"({str(err).splitlines()[0] if str(err) else type(err).__name__}): "
                         f"{fix}")
    if batch == 1 and single:
        # BatchNorm in training normalises each channel over the batch and the feature map:
        # one value has no variance, and torch refuses it in the first step
        raise UsageError(f"--batch-size 1 with --model {name} on "
                         f"{'x'.join(map(str, input_shape))} images: its BatchNorm {single[0]} "
                         f"sees one value per channel (a 1x1 feature map), which it cannot "
                         f"normalise in training: use --batch-size 2 or more")
    return model.train()
