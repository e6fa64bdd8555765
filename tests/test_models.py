"""The models as the scripts build them (training/models.py): a torchvision classifier with
auxiliary heads returns plain logits in training, as every other model does; a model that
takes one image size only says which size, as a flag a user can add; and a batch of one image
that BatchNorm cannot train on is refused before the first step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from training import memory, models
from training.faults import UsageError


@pytest.mark.parametrize("name, side", [("googlenet", 64), ("inception_v3", 96)])
def test_a_model_with_auxiliary_heads_trains_on_its_logits(name, side):
    """They returned a (logits, aux2, aux1) tuple in training mode, which the scripts' loss and
    the memory model's count took for a tensor: --model googlenet ended on a traceback."""
    assert name in models.AUXILIARY_HEADS
    torch.manual_seed(0)
    model = models.build_model(name, 10, (3, side, side))
    assert model.training
    logits = model(torch.randn(2, 3, side, side))
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, 10)
    F.cross_entropy(logits, torch.tensor([1, 7])).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    # the preflight's count of what the forward saves, where the traceback was
    assert memory.saved_for_backward(model, (3, side, side), "off").per_image > 0


def test_a_vit_at_another_size_is_told_the_image_size_it_takes():
    """--model vit_b_16 on 64 px images was told to choose --model resnet50; the fix for a user
    who wants a ViT is --image-size 224, which then builds."""
    with pytest.raises(UsageError) as refused:
        models.build_model("vit_b_16", 200, (3, 64, 64))
    assert str(refused.value).endswith(
        "add --image-size 224 (synthetic or TinyImageNet data) or choose --model resnet50")
    assert "cannot take this dataset's 3x64x64 images" in str(refused.value)
    assert models.build_model("vit_b_16", 200, (3, 224, 224)).training


def test_a_model_too_deep_for_64_px_is_told_an_image_size_it_takes():
    """Inception v3 (75 px or more) on TinyImageNet's 64 px was told to choose --model resnet50,
    though --image-size 224 trains it."""
    with pytest.raises(UsageError) as refused:
        models.build_model("inception_v3", 200, (3, 64, 64))
    assert str(refused.value).endswith(
        "add --image-size 224 (synthetic or TinyImageNet data) or choose --model resnet50")


def test_a_model_that_no_image_size_fixes_keeps_the_general_advice(monkeypatch):
    with monkeypatch.context() as m:  # as if 224 px did not help either
        m.setattr(models, "_refusal", lambda model, shape: RuntimeError("too small"))
        with pytest.raises(UsageError) as refused:
            models.build_model("squeezenet1_1", 10, (3, 16, 16))
    assert str(refused.value).endswith(": choose --model resnet50")
    with pytest.raises(UsageError) as refused:  # too small for its pooling, fine at 224 px
        models.build_model("squeezenet1_1", 10, (3, 16, 16))
    assert str(refused.value).endswith(": add --image-size 224 (synthetic or TinyImageNet data) "
                                       "or choose --model resnet50")


def test_a_batch_of_one_that_batchnorm_cannot_normalise_is_refused_before_training():
    """ResNet-18 at 32 px ends its last stage on 1x1 feature maps: at one image per step each
    BatchNorm there sees one value per channel, and torch's ValueError came in the first step."""
    with pytest.raises(UsageError) as refused:
        models.build_model("resnet18", 10, (3, 32, 32), batch=1)
    assert "its BatchNorm layer4.0.bn1 sees one value per channel" in str(refused.value)
    assert str(refused.value).endswith(": use --batch-size 2 or more")
    for shape, batch in (((3, 32, 32), 2), ((3, 64, 64), 1)):  # the advice, and 2x2 maps
        model = models.build_model("resnet18", 10, shape, batch=batch)
        model(torch.randn(batch, *shape)).sum().backward()  # trains: BatchNorm accepts it
    models.build_model("cnn", 10, (3, 32, 32), batch=1)  # no BatchNorm: any batch


def test_estimate_memory_refuses_the_batch_of_one_that_training_refuses():
    import ddp_train
    from training import flags
    args = ddp_train.build_parser().parse_args(["--estimate-memory", "1", "--model", "resnet18",
                                                "--image-size", "32", "--batch-size", "1"])
    flags.check_flags(args)
    with pytest.raises(UsageError, match="use --batch-size 2 or more$"):
        memory.estimate_only(args, ddp_train.memory_per_gpu, ddp_train.MEMORY_VARIANTS)
