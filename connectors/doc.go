// Package connectors holds everything that talks to the outside world, one
// sub-package per system: NATS JetStream (with a watermill publisher and
// subscriber), world-model servers, sandboxes, Parquet files, Prometheus.
package connectors
