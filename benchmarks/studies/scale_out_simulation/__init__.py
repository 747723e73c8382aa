"""Chapter 9 past this machine: replicas and routers, simulated on chapter 8's measured step."""
