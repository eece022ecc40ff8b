"""ftmem for Megatron: in-memory checkpoints behind Megatron's flags, its
``--ckpt-format torch`` persistent checkpoints; apart from them, in :mod:`ftmem_megatron.cpu`,
the CPU support that runs megatron-core and Megatron-LM's loop over gloo where no GPU is
present (switched on explicitly by a script). A GPT
pretraining driver on megatron-core with Megatron-LM's flag names ships beside the
library: ``python -m examples.megatron.pretrain_gpt``.

For Megatron-LM itself: ``import ftmem_megatron; ftmem_megatron.install()`` at the top
of ``pretrain_gpt.py`` gives it ``--non-persistent-ckpt-type in_memory`` (see
:mod:`ftmem_megatron.megatron_lm`), or apply ``patches/megatron-lm-0.19.2-ftmem.patch``."""


def install() -> None:
    """Hook ftmem into an unpatched Megatron-LM (imports it; idempotent)."""
    from .megatron_lm import install as _install

    _install()
