"""ftmem for Megatron: in-memory checkpoints behind Megatron's flags, its
``--ckpt-format torch`` persistent checkpoints, and the compatibility layer that runs
megatron-core on CPU (gloo) where no GPU is present (``cpu_compat.enable()``). A GPT
pretraining driver on megatron-core with Megatron-LM's flag names ships beside the
library: ``python -m examples.megatron.pretrain_gpt``.

For Megatron-LM itself: ``import ftmem_megatron; ftmem_megatron.install()`` at the top
of ``pretrain_gpt.py`` gives it ``--non-persistent-ckpt-type in_memory`` (see
:mod:`ftmem_megatron.megatron_lm`), or apply ``patches/megatron-lm-0.19.2-ftmem.patch``."""


def install() -> None:
    """Hook ftmem into an unpatched Megatron-LM (imports it; idempotent)."""
    from .megatron_lm import install as _install

    _install()
