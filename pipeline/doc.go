// Package pipeline wires the stages together: configuration, the topology
// (which stage reads and writes which subject), and starting and stopping
// them over NATS JetStream, embedded or external.
package pipeline
