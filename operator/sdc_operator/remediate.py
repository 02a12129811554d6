"""Node remediation through SageMaker HyperPod: BatchRebootClusterNodes and
BatchReplaceClusterNodes (boto3 ``sagemaker``), one node per call.

A per-node failure in the response (``Failed[]``) is a failed action: the engine records it
and retries with back-off. The endpoint is boto3's: set ``AWS_ENDPOINT_URL_SAGEMAKER`` for a
VPC endpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["HyperPodNodes"]

_OPERATIONS = {"reboot": "batch_reboot_cluster_nodes", "replace": "batch_replace_cluster_nodes"}


class HyperPodNodes:
    def __init__(self, sagemaker: Callable[[], Any]) -> None:
        """``sagemaker`` builds a boto3 SageMaker client; called once, lazily."""
        self._make_client = sagemaker
        self._client: Any = None

    async def remediate(self, action: str, cluster: str, instance_id: str) -> tuple[bool, str]:
        """``(succeeded, message)`` for ``reboot`` or ``replace`` of one node."""
        return await asyncio.to_thread(self._call, action, cluster, instance_id)

    def _call(self, action: str, cluster: str, instance_id: str) -> tuple[bool, str]:
        if self._client is None:
            self._client = self._make_client()
        operation = getattr(self._client, _OPERATIONS[action])
        name = "Batch" + action.capitalize() + "ClusterNodes"
        try:
            response = operation(ClusterName=cluster, NodeIds=[instance_id])
        except Exception as exc:  # botocore's errors are many; the message says which
            return False, f"{name}({cluster}, {instance_id}) failed: {exc}"
        for failure in response.get("Failed") or []:
            if failure.get("NodeId") == instance_id:
                return False, (
                    f"{name}({cluster}) refused {instance_id}: "
                    f"{failure.get('ErrorCode')}: {failure.get('Message')}"
                )
        if instance_id in (response.get("Successful") or []):
            return True, f"{name}({cluster}) accepted {instance_id}"
        return False, f"{name}({cluster}) did not mention {instance_id}: {response}"
