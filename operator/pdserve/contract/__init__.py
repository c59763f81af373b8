"""What the operator and the processes it deploys agree on: the custom resource's identity,
labels, annotations and ports of the objects it creates, and the routing config the gateway
reads. Written once here; both sides import it."""
