// pdserve's compiled data plane (see main.go). Standard library only: nothing to download.
module pdserve.io/dataplane

go 1.22
