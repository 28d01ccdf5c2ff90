# RabbitMQ from Debian's package (the release fleet's tests run against), with the management
# UI (15672) and the Prometheus endpoint (15692) enabled, running as the user `rabbitmq`.
#
#   docker build -f ops/images/rabbitmq.Dockerfile -t fleet-rabbitmq ops/images
#
# BASE_IMAGE is any Debian bookworm image: debian:bookworm-slim where images can be pulled,
# local/debian:bookworm made by ops/compose-test.sh (debootstrap) where they cannot.
# Credentials are not baked in: the first start creates RABBITMQ_DEFAULT_USER /
# RABBITMQ_DEFAULT_PASS from the environment (docker-compose.yml passes the env file).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends rabbitmq-server \
 && rm -rf /var/lib/apt/lists/* /var/log/rabbitmq/* /var/lib/rabbitmq/* \
 && rabbitmq-plugins --offline enable rabbitmq_management rabbitmq_prometheus \
 && rm -f /etc/rabbitmq/rabbitmq-env.conf \
 && mkdir -p /etc/rabbitmq/conf.d \
 && printf '%s\n' 'loopback_users.guest = true' 'listeners.tcp.default = 5672' \
        'management.tcp.port = 15672' >/etc/rabbitmq/conf.d/10-defaults.conf \
 && chown -R rabbitmq:rabbitmq /etc/rabbitmq /var/lib/rabbitmq
# Logs to stdout; the node is rabbit@<container hostname> (compose sets `hostname:`).
ENV RABBITMQ_LOGS=- RABBITMQ_SASL_LOGS=-
USER rabbitmq
WORKDIR /var/lib/rabbitmq
VOLUME /var/lib/rabbitmq
EXPOSE 5672 15672 15692
HEALTHCHECK --interval=10s --timeout=10s --start-period=30s --retries=12 \
    CMD ["rabbitmq-diagnostics", "-q", "check_port_connectivity"]
# The script behind /usr/sbin/rabbitmq-server sends the log to a file; this one to stdout.
CMD ["/usr/lib/rabbitmq/bin/rabbitmq-server"]
