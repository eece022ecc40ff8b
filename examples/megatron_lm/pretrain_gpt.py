"""Pretrain a GPT with Megatron-LM's own training loop and ftmem's in-memory checkpoints:
a launch script as a Megatron-LM user writes one (model provider, dataset provider,
forward step, ``pretrain``), taking Megatron-LM's own flags::

    torchrun --nproc-per-node 4 -m examples.megatron_lm.pretrain_gpt \\
        --tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 ... --mock-data \\
        --save ckpt --load ckpt --save-interval 100 --ckpt-format torch \\
        --non-persistent-ckpt-type in_memory --non-persistent-save-interval 1 \\
        --ftmem-ec-k 3 --ftmem-ec-m 1

What ftmem asks of such a script is its first lines: ``ftmem_megatron.install()`` before
Megatron-LM parses its args (on a Megatron-LM with ``patches/megatron-lm-0.19.2-ftmem.patch``
it changes nothing). Without CUDA the script enables :mod:`ftmem_megatron.cpu.megatron_lm`,
which needs the flags its docstring lists. The data is Megatron's mock GPT dataset.
"""
from __future__ import annotations

import torch

import ftmem_megatron

ftmem_megatron.install()  # before Megatron-LM parses its args: adds and checks the --ftmem-* flags

from megatron.core import parallel_state  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.training import get_args, get_tokenizer, pretrain  # noqa: E402
from megatron.training.argument_utils import pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args  # noqa: E402

from examples.process_end import end_process  # noqa: E402
from ftmem_megatron.cpu import megatron_lm as megatron_lm_cpu  # noqa: E402

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


def model_provider(pre_process: bool = True, post_process: bool = True, **_: object) -> GPTModel:
    args = get_args()
    return GPTModel(config=core_transformer_config_from_args(args), transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process)


def datasets_provider(num_samples: list[int]):
    """Megatron's mock GPT dataset, built on the first rank of each tensor-parallel group
    (which reads the batches and hands them to the group: :func:`get_batch`)."""
    args = get_args()
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, split="1,0,0",
                              tokenizer=get_tokenizer(), reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False)
    return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples,
                                         lambda: parallel_state.get_tensor_model_parallel_rank() == 0, config).build()


datasets_provider.is_distributed = True  # called on every rank; the builder picks where data is built


def get_batch(data_iterator) -> dict:
    """This micro-batch, read on the tensor-parallel group's first rank and broadcast to the others."""
    args = get_args()
    tokens = (args.micro_batch_size, args.seq_length)
    like = {"tokens": (tokens, torch.int64), "labels": (tokens, torch.int64), "loss_mask": (tokens, torch.float32),
            "position_ids": (tokens, torch.int64),
            "attention_mask": ((args.micro_batch_size, 1, args.seq_length, args.seq_length), torch.bool)}
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        read = next(data_iterator)
        batch = {key: read[key].to(device=device, dtype=like[key][1]) for key in BATCH_KEYS}
    else:
        batch = {key: torch.empty(like[key][0], dtype=like[key][1], device=device) for key in BATCH_KEYS}
    for key in BATCH_KEYS:
        torch.distributed.broadcast(batch[key], parallel_state.get_tensor_model_parallel_src_rank(),
                                    group=parallel_state.get_tensor_model_parallel_group())
    return batch


def forward_step(data_iterator, model):
    batch = get_batch(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

    def loss_func(per_token_losses: torch.Tensor):
        mask = batch["loss_mask"].view(-1)
        loss = torch.sum(per_token_losses.float().view(-1) * mask)
        tokens = mask.sum().to(torch.int)
        return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1).float()])}

    return output, loss_func


def main() -> None:
    if not torch.cuda.is_available():
        megatron_lm_cpu.enable()
    args = parse_and_validate_args()
    try:
        pretrain(pretrain_cfg_container_from_args(args, model_cfg=None), datasets_provider,
                 ModelType.encoder_or_decoder, forward_step, model_provider)
    except SystemExit as e:  # how Megatron-LM ends at --exit-interval, --exit-duration-in-mins or a signal
        end_process(e.code)  # inside the handler: ftmem sees the exit and its code
    end_process()


if __name__ == "__main__":
    main()
