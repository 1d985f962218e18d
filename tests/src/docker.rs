pub struct Dockerd;
