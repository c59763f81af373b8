/* The pod sandbox process for the local real node: it holds the pod's namespaces open, reaps
 * zombies (it is PID 1 there) and exits on SIGTERM/SIGINT. Built statically by
 * devtools/images.py, since no registry can serve registry.k8s.io/pause here. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void leave(int signal_number) { _exit(signal_number == SIGTERM ? 0 : 2); }

static void reap(int signal_number) {
  (void)signal_number;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction on_stop = {.sa_handler = leave};
  struct sigaction on_child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  sigaction(SIGTERM, &on_stop, NULL);
  sigaction(SIGINT, &on_stop, NULL);
  sigaction(SIGCHLD, &on_child, NULL);
  for (;;) pause();
  return EXIT_SUCCESS;
}
