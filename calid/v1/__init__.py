"""Generated gRPC code for protos/calid/v1/calid.proto (scripts/gen_proto.sh); do not edit."""
