"""Open Inference Protocol v2 over gRPC: grpc_predict_v2.proto and the modules protoc generates from it
(checked in; `generate` regenerates them, ``make proto``)."""
