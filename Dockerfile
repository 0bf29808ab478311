# ztunnel-py: a drop-in for the Rust ztunnel container of Istio's Helm chart.
# The chart runs the image with args `proxy ztunnel`, env from the downward API, and mounts
# /var/run/ztunnel (ZDS socket), /var/run/secrets/tokens (istio-token) and
# /var/run/secrets/istio (root-cert.pem). The Rust defaults use paths relative to "/", so WORKDIR is /.
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ztunnel ./ztunnel
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim-bookworm
COPY --from=build /install /usr/local
# The Istio release this image is deployed with (docker build --build-arg istio_version=1.28.1):
# as in Istio's own ztunnel image, ISTIO_META_ISTIO_VERSION reaches istiod as node metadata
# ISTIO_VERSION and is the tag of istio_build and /config_dump's version.istioVersion.
ARG istio_version
# No shell tools are needed at run time; istio-cni owns iptables.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    ISTIO_META_ISTIO_VERSION=$istio_version
WORKDIR /
EXPOSE 15001 15006 15008 15020 15021
ENTRYPOINT ["/usr/local/bin/ztunnel"]
CMD ["proxy", "ztunnel"]
