"""A SageMaker endpoint on loopback for the operator process (which finds it through
boto3's ``AWS_ENDPOINT_URL_SAGEMAKER``), for the APIs moto lacks (BatchRebootClusterNodes,
BatchReplaceClusterNodes) and DescribeClusterNode as those calls change it.

Like botocore's Stubber, which cannot reach into another process, it checks every request
against botocore's SageMaker service model and every response against the operation's
output shape, and records the calls. It keeps each instance's status as HyperPod would
show it: ``Running``, then ``ShuttingDown`` once a replace is accepted and ``Pending``
once a reboot is (instances it was never told about are ``Running``).
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import botocore.session
from botocore.validate import ParamValidator

MODEL = botocore.session.get_session().get_service_model("sagemaker")
_AFTER = {"BatchReplaceClusterNodes": "ShuttingDown", "BatchRebootClusterNodes": "Pending"}


class FakeSageMaker:
    def __init__(
        self,
        responses: dict[str, list[dict[str, Any]]] | None = None,
        *,
        on_call: Callable[[str, dict[str, Any]], None] | None = None,
        lose_answers: dict[str, int] | None = None,
    ) -> None:
        """``responses[operation]`` are answered in turn; once used up, every node asked
        for is reported successful. ``on_call(operation, params)`` runs after a call is
        recorded and before it is answered (it may block: a call in flight).
        ``lose_answers[operation]``: that many calls are acted on and then answered 500, as
        when SageMaker acted but its answer was lost on the way back."""
        self.lose_answers = dict(lose_answers or {})
        self.responses = {k: list(v) for k, v in (responses or {}).items()}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.invalid: list[str] = []
        self.status: dict[str, str] = {}
        self.on_call = on_call
        self._lock = threading.Lock()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                operation = self.headers.get("X-Amz-Target", "").rsplit(".", 1)[-1]
                status, answer = owner.handle(operation, json.loads(body or b"{}"))
                data = json.dumps(answer).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/x-amz-json-1.1")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the caller died while its call was in flight
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def count(self, operation: str) -> int:
        with self._lock:
            return sum(1 for name, _ in self.calls if name == operation)

    def handle(self, operation: str, params: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if operation not in MODEL.operation_names:
            self.invalid.append(f"unknown operation {operation!r}")
            return 400, {"__type": "UnknownOperationException", "message": operation}
        op = MODEL.operation_model(operation)
        report = ParamValidator().validate(params, op.input_shape)
        if report.has_errors():
            self.invalid.append(f"{operation}: {report.generate_report()}")
            return 400, {"__type": "ValidationException", "message": report.generate_report()}
        if operation == "DescribeClusterNode":
            answer = self._describe(params)
        else:
            with self._lock:
                self.calls.append((operation, params))
                queued = self.responses.get(operation) or []
                answer = (
                    queued.pop(0) if queued else {"Successful": list(params.get("NodeIds") or [])}
                )
                for node in answer.get("Successful") or []:
                    if operation in _AFTER:
                        self.status[node] = _AFTER[operation]
                lost = self.lose_answers.get(operation, 0) > 0
                if lost:
                    self.lose_answers[operation] -= 1
            if self.on_call is not None:
                self.on_call(operation, params)
            if lost:
                return 500, {"__type": "InternalFailure", "message": "the answer was lost"}
        checked = ParamValidator().validate(answer, op.output_shape)
        if checked.has_errors():  # a broken script is the test's bug: the test fails on it
            self.invalid.append(f"scripted {operation} response: {checked.generate_report()}")
            return 500, {"__type": "InternalFailure", "message": "invalid scripted response"}
        return 200, answer

    def _describe(self, params: dict[str, Any]) -> dict[str, Any]:
        node = str(params.get("NodeId") or "")
        with self._lock:
            status = self.status.get(node, "Running")
        return {
            "NodeDetails": {
                "InstanceId": node,
                "InstanceGroupName": "workers",
                "InstanceType": "ml.p5.48xlarge",
                "InstanceStatus": {"Status": status, "Message": f"instance is {status}"},
                "LaunchTime": time.time() - 86400,
            }
        }

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL_SAGEMAKER": self.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
