"""The Kubernetes client every pdserve process uses (the operator, the gateway): credentials
from a kubeconfig or the pod's service account, and a small async REST client."""
