"""Node remediation through SageMaker HyperPod: BatchRebootClusterNodes and
BatchReplaceClusterNodes (boto3 ``sagemaker``), one node per call, and DescribeClusterNode
to find out, after a restart, whether a call that may have been made took effect.

A per-node failure in the response (``Failed[]``), or a refusal (a 4xx error), is a failed
action: the engine records it and retries with back-off. A call whose fate is unknown (no
answer, a connection reset, a 5xx: SageMaker may have acted) is never repeated blind: the
action stays ``Pending`` and is verified with DescribeClusterNode, as after a crash. So the
client is made without botocore's own retries (:func:`client_config`). The endpoint is
boto3's: set ``AWS_ENDPOINT_URL_SAGEMAKER`` for a VPC endpoint. boto3 blocks, so each call
runs on this module's own small thread pool, never the one the rest of the process might
share.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

__all__ = ["HyperPodNodes", "client_config", "took_effect"]

_OPERATIONS = {"reboot": "batch_reboot_cluster_nodes", "replace": "batch_replace_cluster_nodes"}
_STILL_RUNNING = frozenset({"Running"})


def client_config() -> Any:
    """botocore settings for the SageMaker client: one attempt per call. botocore's retries
    resend a Batch* call after a read timeout or a 5xx, which may have been acted on."""
    from botocore.config import Config

    return Config(retries={"total_max_attempts": 1})


def _refused(exc: Exception) -> bool:
    """The call was answered with a refusal (a 4xx, or botocore refused to send it), so
    nothing happened; otherwise its fate is unknown."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return isinstance(status, int) and 400 <= status < 500
    from botocore.exceptions import ParamValidationError

    return isinstance(exc, ParamValidationError)


def took_effect(action: str, described: dict[str, Any] | None) -> bool | None:
    """Whether a ``reboot`` or ``replace`` of the node ``described`` (DescribeClusterNode's
    ``NodeDetails``; ``None``: the instance is gone) has taken effect: ``True``, or
    ``None`` when it cannot be told yet (the instance still ``Running``).

    A replaced instance shuts down and disappears; a rebooting one leaves ``Running`` for a
    while. Any status but ``Running`` counts as the request having reached HyperPod.
    """
    if described is None:
        return True
    status = ((described.get("InstanceStatus") or {}).get("Status")) or ""
    if status in _STILL_RUNNING:
        return None
    return True


class HyperPodNodes:
    def __init__(self, sagemaker: Callable[[], Any]) -> None:
        """``sagemaker`` builds a boto3 SageMaker client; called once, lazily."""
        self._make_client = sagemaker
        self._client: Any = None
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="sagemaker")

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _sm(self) -> Any:
        if self._client is None:
            self._client = self._make_client()
        return self._client

    async def remediate(
        self, action: str, cluster: str, instance_id: str
    ) -> tuple[bool | None, str]:
        """``(succeeded, message)`` for ``reboot`` or ``replace`` of one node; ``succeeded``
        is ``None`` where it cannot be told (no answer: SageMaker may have acted)."""
        result: tuple[bool | None, str] = await self._run(self._call, action, cluster, instance_id)
        return result

    async def describe(self, cluster: str, instance_id: str) -> dict[str, Any] | None:
        """DescribeClusterNode's ``NodeDetails``, ``None`` if the instance is not found;
        raises on any other error."""
        found: dict[str, Any] | None = await self._run(self._describe, cluster, instance_id)
        return found

    def _describe(self, cluster: str, instance_id: str) -> dict[str, Any] | None:
        client = self._sm()
        try:
            response = client.describe_cluster_node(ClusterName=cluster, NodeId=instance_id)
        except Exception as exc:
            code = getattr(exc, "response", {}).get("Error", {}).get("Code")
            if code in ("ResourceNotFound", "ResourceNotFoundException"):
                return None
            raise
        return dict(response.get("NodeDetails") or {})

    def _call(self, action: str, cluster: str, instance_id: str) -> tuple[bool | None, str]:
        operation = getattr(self._sm(), _OPERATIONS[action])
        name = "Batch" + action.capitalize() + "ClusterNodes"
        try:
            response = operation(ClusterName=cluster, NodeIds=[instance_id])
        except Exception as exc:  # botocore's errors are many; the message says which
            if _refused(exc):
                return False, f"{name}({cluster}, {instance_id}) failed: {exc}"
            return None, f"{name}({cluster}, {instance_id}) got no answer: {exc}"
        for failure in response.get("Failed") or []:
            if failure.get("NodeId") == instance_id:
                return False, (
                    f"{name}({cluster}) refused {instance_id}: "
                    f"{failure.get('ErrorCode')}: {failure.get('Message')}"
                )
        if instance_id in (response.get("Successful") or []):
            return True, f"{name}({cluster}) accepted {instance_id}"
        return False, f"{name}({cluster}) did not mention {instance_id}: {response}"

    async def finish(self, timeout: float) -> bool:
        """Wait (up to ``timeout``) for the calls already sent to end, and take no more;
        whether they ended. The Lease is given up after this: a call still in flight then
        could meet the next leader's verification of the same intent."""
        done = asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)
        try:
            await asyncio.wait_for(done, timeout)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
