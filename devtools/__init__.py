"""Developer tooling, not shipped in the pdserve wheel: the local control plane built from Go
modules (`make cluster-up`), the real node (kubelet, containerd, CNI), image builds with
buildah, the demo, and the helpers the cluster and end-to-end tests drive them with. Nothing
here imports the tests."""
