# The hyperpod-sdc operator image. Two stages: build a wheel, then install it with the
# operator's dependencies only (no torch: the operator never imports it) into a slim
# image that runs as a non-root user.
#
#   docker build -t hyperpod-sdc-operator .
#
# The agent is not in this image: install it into the training image with
#   pip install 'hyperpod-sdc[agent]'

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY sidecar ./sidecar
COPY operator ./operator
COPY common ./common
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
 && pip wheel --no-cache-dir --wheel-dir /wheels -c constraints.txt \
        "$(ls /wheels/hyperpod_sdc-*.whl)[operator]"

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels "hyperpod-sdc[operator]" \
 && rm -rf /wheels \
 && python -c "import sdc_operator.handlers, sys; assert 'torch' not in sys.modules and 'sdc_agent' not in sys.modules"
USER 65532:65532
EXPOSE 8443
ENTRYPOINT ["python", "-m", "sdc_operator"]
