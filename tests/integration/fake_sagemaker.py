"""A SageMaker endpoint on loopback for the operator process (which finds it through
boto3's ``AWS_ENDPOINT_URL_SAGEMAKER``), for the APIs moto lacks (BatchRebootClusterNodes,
BatchReplaceClusterNodes).

Like botocore's Stubber, which cannot reach into another process, it checks every request
against botocore's SageMaker service model and every scripted response against the
operation's output shape, and records the calls.
"""

from __future__ import annotations

import http.server
import json
import threading
from typing import Any

import botocore.session
from botocore.validate import ParamValidator

MODEL = botocore.session.get_session().get_service_model("sagemaker")


class FakeSageMaker:
    def __init__(self, responses: dict[str, list[dict[str, Any]]] | None = None) -> None:
        """``responses[operation]`` are answered in turn; once used up, every node asked
        for is reported successful."""
        self.responses = {k: list(v) for k, v in (responses or {}).items()}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.invalid: list[str] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                operation = self.headers.get("X-Amz-Target", "").rsplit(".", 1)[-1]
                status, answer = owner.handle(operation, json.loads(body or b"{}"))
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/x-amz-json-1.1")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def handle(self, operation: str, params: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if operation not in MODEL.operation_names:
            self.invalid.append(f"unknown operation {operation!r}")
            return 400, {"__type": "UnknownOperationException", "message": operation}
        op = MODEL.operation_model(operation)
        report = ParamValidator().validate(params, op.input_shape)
        if report.has_errors():
            self.invalid.append(f"{operation}: {report.generate_report()}")
            return 400, {"__type": "ValidationException", "message": report.generate_report()}
        self.calls.append((operation, params))
        queued = self.responses.get(operation) or []
        answer = queued.pop(0) if queued else {"Successful": list(params.get("NodeIds") or [])}
        checked = ParamValidator().validate(answer, op.output_shape)
        if checked.has_errors():  # a broken script is the test's bug: the test fails on it
            self.invalid.append(f"scripted {operation} response: {checked.generate_report()}")
            return 500, {"__type": "InternalFailure", "message": "invalid scripted response"}
        return 200, answer

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
