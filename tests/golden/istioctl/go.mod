module ztunnelpy/istioctldecoder

go 1.19
